"""Suite-wide settings. Every rank the tests launch compares each collective's signature (op,
shape, dtype, order) with its group before issuing it (``tensorpar.distributed.flight``): a test whose
ranks issue different collectives fails naming both calls instead of passing with a wrong result
or timing out. Spawned ranks inherit the variable.

The order of the files: ``make test`` runs two xdist workers, each a whole file at a time
(``--dist loadfile``), so the suite lasts as long as the busier worker. The files that take
longest start first (:data:`LONGEST_FIRST`) and the short ones even out the two workers' ends;
xdist's own order (the files with the most tests first) can leave a long file to start last."""
import os

os.environ.setdefault("TENSORPAR_CHECK_COLLECTIVES", "1")

# Seconds each took in `make test` on the 2 shared cores (three runs, 2026-12-04; a file's time
# grows with what runs beside it), longest first. The files not listed (under ~20 s each) follow,
# in collection order.
LONGEST_FIRST = (
    "test_dist.py",  # 160-200, most of it waiting for timeouts
    "test_planner_coverage.py",  # 55-170, one process, no ranks
    "test_models_matrix.py",  # 30-100
    "test_cli_jobs.py",  # 35-80
    "test_pipeline.py",  # 30-55
    "test_dist_shm.py",  # 40
    "test_models_saving.py",  # 30-45
    "test_serve_server.py",  # 30-55
    "test_bench.py",  # 30-45
    "test_docs.py",  # 30-40
    "test_models_mesh.py",  # 20-40
    "test_models_parallelize.py",  # 20-45
    "test_planner_inventory_ranks.py",  # 12-60
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's: this order instead of its own
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order

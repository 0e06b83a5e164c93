"""Suite-wide settings. Every rank the tests launch compares each collective's signature (op,
shape, dtype, order) with its group before issuing it (``tensorpar.distributed.flight``): a test whose
ranks issue different collectives fails naming both calls instead of passing with a wrong result
or timing out. Spawned ranks inherit the variable."""
import os

os.environ.setdefault("TENSORPAR_CHECK_COLLECTIVES", "1")

"""A checkpoint folder from elsewhere can neither run code nor make tensorpar read, write or
delete outside it; a bad destination, a full disk, a damaged record or another optimizer is one
line naming the file. All in this process (DCP reads and writes without a process group).

Each crafted case is built so that code without the check it tests would go wrong visibly: a
pickle that would create a marker file, names and symlinks that lead to a whole, loadable copy of
the checkpoint outside the folder (the "victim"), a ``latest`` that led a save to delete it.
Refused means: a ``ValueError`` holding the expected words, on one line, with the model's
parameters, the optimizer's state, the victim and the marker's absence as they were."""
import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tensorpar.distributed import dcp
from tensorpar.models import saving
from tensorpar.models.tiny import make_tiny_model

MARKER = "MARKER-ran"  # created in the crafted checkpoint's parent folder if the payload ever runs


class Payload:
    """Pickles as a call of ``exec`` that creates the marker: what a crafted checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _model():
    model = make_tiny_model("llama", seed=2).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _trained(optimizer=torch.optim.AdamW, **hyper):
    model = make_tiny_model("llama", seed=1).train()
    opt = optimizer(model.parameters(), **({"lr": 1e-2} | hyper))
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A whole checkpoint root (``latest`` -> ``step-00000003``), saved once for the module."""
    model, opt = _trained()
    root = tmp_path_factory.mktemp("good") / "ckpt"
    saving.save(model, opt, root, step=3)
    return root


# ---- the crafted folders ---------------------------------------------------------------------------

def _rewrite_metadata(step: Path, change) -> None:
    meta = dcp.checked_metadata(step)  # read safely, changed, pickled back as a crafter would
    change(meta)
    (step / dcp.METADATA).write_bytes(pickle.dumps(meta))


def _point_item(step: Path, key: str, data: bytes) -> None:
    """The non-tensor item ``key`` now reads ``data``, appended to its data file."""
    def change(meta):
        index = next(i for i in meta.storage_data if i.fqn == key)
        info = meta.storage_data[index]
        f = step / info.relative_path
        info.offset, info.length = f.stat().st_size, len(data)
        with open(f, "ab") as out:
            out.write(data)
    _rewrite_metadata(step, change)


def _rename_data(name_of):
    def change(meta):
        for info in meta.storage_data.values():
            info.relative_path = name_of(info.relative_path)
    return change


def _metadata_pickle(step: Path, root: Path) -> None:
    """The real metadata with one field replaced by the payload: refused even when nested."""
    meta = dcp.checked_metadata(step)
    meta.storage_meta = Payload(root.parent / MARKER)
    (step / dcp.METADATA).write_bytes(pickle.dumps(meta))


def _object_pickle(step: Path, root: Path) -> None:
    buf = io.BytesIO()
    torch.save(Payload(root.parent / MARKER), buf)
    _point_item(step, "step", buf.getvalue())


def _wrong_chunks(meta) -> None:
    """A tensor entry whose chunk list is a string: DCP's planner would fail deep inside."""
    next(v for v in meta.state_dict_metadata.values() if hasattr(v, "chunks")).chunks = "not chunks"


def _symlink(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _step_symlink(step: Path, root: Path) -> None:
    (root / "step-00000009").symlink_to(root.parent / "victim" / "step-00000003", target_is_directory=True)
    (root / "latest").write_text("step-00000009")


def _latest_symlink(step: Path, root: Path) -> None:
    (root.parent / "pointer").write_text("step-00000003")
    _symlink(root / "latest", root.parent / "pointer")


# name: (how the copy of ``good`` is changed: f(step folder, root), the words of the refusal)
CRAFTED = {
    "pickle_in_metadata": (_metadata_pickle, "refused: its pickle asks for builtins.exec"),
    "garbage_metadata": (lambda s, r: (s / ".metadata").write_bytes(b"\x80\x04not a pickle" * 8),
                         "is not a DCP checkpoint's metadata"),
    "metadata_wrong_types": (lambda s, r: _rewrite_metadata(s, _wrong_chunks),
                             "is not a DCP checkpoint's metadata: it unpickles to Metadata without"),
    "pickle_in_object": (_object_pickle, "item 'step' is refused: it does not load as plain data"),
    "data_path_dotdot": (lambda s, r: _rewrite_metadata(s, _rename_data(lambda n: f"../../victim/step-00000003/{n}")),
                         "names the data file '../../victim/step-00000003/__0_0.distcp': refused"),
    "data_path_absolute": (lambda s, r: _rewrite_metadata(
        s, _rename_data(lambda n: str(r.parent / "victim" / "step-00000003" / n))), "names the data file '/"),
    "latest_dotdot": (lambda s, r: (r / "latest").write_text("../victim/step-00000003"),
                      "names '../victim/step-00000003': refused, latest must name a step folder"),
    "latest_absolute": (lambda s, r: (r / "latest").write_text(str(r.parent / "victim" / "step-00000003")),
                        "refused, latest must name a step folder"),
    "latest_symlink": (_latest_symlink, "latest is a symlink (to "),
    "step_folder_symlink": (_step_symlink, "names step-00000009, which is a symlink: refused"),
    "data_file_symlink": (lambda s, r: _symlink(s / "__0_0.distcp", r.parent / "victim" / "step-00000003" /
                                                "__0_0.distcp"), "__0_0.distcp is a symlink (to "),
    "metadata_symlink": (lambda s, r: _symlink(s / ".metadata", r.parent / "victim" / "step-00000003" / ".metadata"),
                         ".metadata is a symlink (to "),
    "complete_symlink": (lambda s, r: _symlink(s / "COMPLETE", r.parent / "victim" / "step-00000003" / "COMPLETE"),
                         "COMPLETE is a symlink (to "),
    "complete_not_json": (lambda s, r: (s / "COMPLETE").write_text("{step: 3"), "COMPLETE is not JSON"),
    "complete_not_a_record": (lambda s, r: (s / "COMPLETE").write_text("[3]"),
                              "is not a tensorpar COMPLETE record: expected a JSON object"),
}


def crafted_checkpoints(root: Path, good_root: Path | None = None) -> dict:
    """``{case: folder}``: under ``root``, one folder per case of :data:`CRAFTED` (``root/<case>/
    ckpt``, beside it the ``victim``: a whole copy of the checkpoint outside it), and ``train_out``
    (an empty folder for a training run's --out). For the tests below and for ``make faults``."""
    if good_root is None:
        model, opt = _trained()
        good_root = saving.save(model, opt, root / "_good", step=3).parent
    out = {"train_out": str(root / "train_out")}
    (root / "train_out").mkdir(parents=True, exist_ok=True)
    for name, (craft, _) in CRAFTED.items():
        ckpt = root / name / "ckpt"
        shutil.copytree(good_root, ckpt, symlinks=True)
        shutil.copytree(good_root, root / name / "victim", symlinks=True)
        craft(ckpt / "step-00000003", ckpt)
        out[name] = str(ckpt)
    return out


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def _nothing_changes(model, opt, case_root: Path):
    """The model, the optimizer, the victim: as they were; the payload never ran."""
    before = [p.detach().clone() for p in model.parameters()]
    victim = _digest(case_root / "victim")
    yield
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state
    assert _digest(case_root / "victim") == victim
    assert not (case_root / MARKER).exists(), "the crafted pickle ran"


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert len(text.splitlines()) == 1, text
    return text


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_checkpoint_is_refused_before_anything_changes(case, good, tmp_path):
    """load, resolve (what `train --resume` calls before launching) and record: each refuses."""
    folder = Path(crafted_checkpoints(tmp_path, good)[case])
    words = CRAFTED[case][1]
    model, opt = _model()
    with _nothing_changes(model, opt, folder.parent):
        for call in (lambda: saving.load(model, opt, folder), lambda: saving.resolve(folder),
                     lambda: saving.record(folder)):
            with pytest.raises(ValueError) as err:
                call()
            assert words in _one_line(err), (case, str(err.value))


@pytest.mark.parametrize("case", ["pickle_in_metadata", "data_path_dotdot", "data_path_absolute",
                                  "data_file_symlink", "metadata_symlink"])
def test_every_read_of_a_dcp_folder_checks_its_metadata(case, good, tmp_path):
    """The DCP layer itself refuses (not only saving's checks in front of it): the metadata, a
    load into a state, the dense tensors an export assembles."""
    step = Path(crafted_checkpoints(tmp_path, good)[case]) / "step-00000003"
    state = {"model.model.norm.weight": torch.zeros(48, dtype=torch.float64)}
    for call in (lambda: dcp.metadata(step), lambda: dcp.read(state, step), lambda: dcp.dense_state(step),
                 lambda: dcp.check_objects(step)):
        with pytest.raises(ValueError) as err:
            call()
        assert CRAFTED[case][1] in _one_line(err)
    assert not state["model.model.norm.weight"].any()
    assert not (step.parent.parent / MARKER).exists()


def test_a_pickled_item_is_refused_by_the_load_planner_itself(good, tmp_path):
    """DCP's own planner would torch.load the item with weights_only=False and run it; the one
    tensorpar gives it does not (saving's check in front of it is passed by)."""
    step = Path(crafted_checkpoints(tmp_path, good)["pickle_in_object"]) / "step-00000003"
    with pytest.raises(ValueError) as err:
        dcp.read({"step": None}, step)
    assert "item 'step' is refused" in _one_line(err)
    assert not (step.parent.parent / MARKER).exists()


@pytest.mark.parametrize("case", ["latest_dotdot", "latest_absolute", "latest_symlink"])
def test_a_save_refuses_a_crafted_latest_and_deletes_nothing_outside(case, good, tmp_path):
    """The same step saved again used to delete the folder ``latest`` named, wherever it was."""
    root = Path(crafted_checkpoints(tmp_path, good)[case])
    before = sorted(p.name for p in root.iterdir())
    victim = _digest(root.parent / "victim")
    model, opt = _trained()
    with pytest.raises(ValueError, match="refused") as err:
        saving.save(model, opt, root, step=3)
    _one_line(err)
    assert _digest(root.parent / "victim") == victim
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written next to it


def test_a_save_beside_a_symlinked_step_folder_leaves_its_target_alone(good, tmp_path):
    root = Path(crafted_checkpoints(tmp_path, good)["step_folder_symlink"])
    (root / "latest").write_text("step-00000009")
    victim = _digest(root.parent / "victim")
    model, opt = _trained()
    final = saving.save(model, opt, root, step=9)
    assert final.name.startswith("step-00000009.") and (root / "latest").read_text() == final.name
    assert (root / "step-00000009").is_symlink() and _digest(root.parent / "victim") == victim


def test_a_valid_checkpoint_still_loads(good, tmp_path):
    """The checks refuse nothing tensorpar writes: a saved root, and a step folder given itself."""
    model, opt = _model()
    assert saving.load(model, opt, good) == 3
    assert saving.record(good / "step-00000003")["optimizer"] == "AdamW"


# ---- the destination: a file, not writable, too small, full -------------------------------------

@pytest.fixture()
def unwritable(tmp_path):
    """A folder this process cannot write into: permissions, or (as root, whom permissions do not
    stop) a read-only tmpfs; skipped where neither can be made."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


@pytest.fixture()
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (smaller than any checkpoint here); skipped where it cannot be mounted."""
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root in a container that allows it)")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def _writers(model, opt, path):
    return {"save": lambda: saving.save(model, opt, path, step=1), "export": lambda: saving.export(model, path)}


def test_a_destination_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    model, opt = _trained()
    for name, call in _writers(model, opt, tmp_path / "f").items():
        with pytest.raises(ValueError) as err:
            call()
        assert f"{str(tmp_path / 'f')!r} is a file, not a folder" in _one_line(err), name
    with pytest.raises(ValueError, match="cannot be made a folder: .* is a file"):
        saving.check_writable(tmp_path / "f" / "below")
    assert (tmp_path / "f").read_text() == "x"


def test_an_unwritable_destination_is_refused(unwritable):
    model, opt = _trained()
    for name, call in _writers(model, opt, unwritable / "ckpt").items():
        with pytest.raises(ValueError) as err:
            call()
        assert f"{str(unwritable / 'ckpt')!r} is not writable: no file can be created in" in _one_line(err), name


def test_an_export_does_not_write_through_a_symlink(tmp_path):
    """An export folder whose model.safetensors links elsewhere: refused, the target untouched."""
    (tmp_path / "victim.bin").write_text("keep")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").symlink_to(tmp_path / "victim.bin")
    model, _ = _trained()
    with pytest.raises(ValueError) as err:
        saving.export(model, tmp_path / "hf")
    assert "model.safetensors is a symlink (to " in _one_line(err)
    assert (tmp_path / "victim.bin").read_text() == "keep"


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    """The free space is checked against what is to be written: the checkpoint's tensors (1.3 MB
    here, with DCP's overhead); for an export twice the model's (its blocks and the file exist at
    once). One byte less is refused, with nothing written; exactly enough is accepted."""
    model, opt = _trained()
    weights = {k: v for k, v in saving._state(model, None, None).items() if k.startswith("model.")}
    needs = {"save": saving._nbytes(saving._state(model, opt, 1)), "export": 2 * saving._nbytes(weights)}
    usage = shutil.disk_usage(tmp_path)
    for free in (-1, 0):
        for name, nbytes in needs.items():
            monkeypatch.setattr(saving.shutil, "disk_usage", lambda p, f=nbytes + free: usage._replace(free=f))
            root = tmp_path / f"{name}{free}"
            if free < 0:
                with pytest.raises(ValueError) as err:
                    _writers(model, opt, root)[name]()
                assert f"not enough free space: {nbytes} bytes to write" in _one_line(err)
                assert list(tmp_path.iterdir()) == [], name
            else:
                _writers(model, opt, root)[name]()


def test_a_disk_that_fills_up_while_writing_is_a_named_error(tiny_disk, monkeypatch):
    """A real 64 KiB tmpfs, the free-space check told there is room: the write itself hits
    ENOSPC, raised as NoSpaceError (an OSError and a ValueError) on one line, the partial files
    removed, nothing published."""
    usage = shutil.disk_usage(tiny_disk)
    monkeypatch.setattr(saving.shutil, "disk_usage", lambda p: usage._replace(free=2**40))
    model, opt = _trained()
    for name, call in _writers(model, opt, tiny_disk / "out").items():
        with pytest.raises(saving.NoSpaceError) as err:
            call()
        assert "the disk filled up while writing" in _one_line(err), name
        assert err.value.errno == 28 and isinstance(err.value, ValueError)
        leftovers = [p for p in tiny_disk.rglob("*") if p.is_file()]
        assert leftovers == [], (name, leftovers)


def test_check_writable_creates_nothing_and_names_the_folder_it_checked(tmp_path, monkeypatch):
    target = tmp_path / "a" / "b"
    assert saving.check_writable(target, 10) == tmp_path
    assert list(tmp_path.iterdir()) == []
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(saving.shutil, "disk_usage", lambda p: usage._replace(free=9))
    with pytest.raises(ValueError, match=r"not enough free space: 10 bytes to write .*, 9 free"):
        saving.check_writable(target, 10)


# ---- the optimizer's kind ------------------------------------------------------------------------

def _saved_with(tmp_path, optimizer, **hyper) -> Path:
    model, opt = _trained(optimizer, **hyper)
    return saving.save(model, opt, tmp_path / optimizer.__name__, step=1)


def test_another_optimizer_kind_is_refused_naming_both(tmp_path):
    folder = _saved_with(tmp_path, torch.optim.AdamW)
    model = make_tiny_model("llama", seed=2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError) as err:
        saving.load(model, sgd, folder)
    assert ("holds the state of AdamW (exp_avg, exp_avg_sq, step), this optimizer is SGD (momentum_buffer): "
            "the optimizer kinds differ") in _one_line(err)
    assert not sgd.state
    adam = torch.optim.Adam(model.parameters())  # the same state names, other hyperparameters
    with pytest.raises(ValueError, match="holds the state of AdamW .* this optimizer is Adam "):
        saving.load(model, adam, folder)


def test_a_record_without_the_kind_is_checked_by_its_state_names(tmp_path):
    """Checkpoints written before the kind was recorded: SGD refused for AdamW's state, AdamW taken."""
    folder = _saved_with(tmp_path, torch.optim.AdamW)
    rec = json.loads((folder / "COMPLETE").read_text())
    (folder / "COMPLETE").write_text(json.dumps({k: v for k, v in rec.items() if k != "optimizer"}))
    model = make_tiny_model("llama", seed=2)
    with pytest.raises(ValueError, match=r"holds the state of another optimizer \(exp_avg, exp_avg_sq, step\), "
                                         r"this optimizer is SGD \(momentum_buffer\)"):
        saving.load(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), folder)
    assert saving.load(model, torch.optim.AdamW(model.parameters()), folder) == 1


# ---- through the command line ------------------------------------------------------------------------

# (argv, the words of the one line on stderr): ``tensorpar train --resume`` on each crafted
# checkpoint, refused in the parent before any rank starts (exit 2). "{name}" is a folder made by
# :func:`crafted_checkpoints`, "{llama}" a tiny Llama checkpoint (tools/faults.py makes both).
_TRAIN = ["train", "--model", "{llama}", "--steps", "9", "--out", "{train_out}", "--resume"]
CHECKPOINT_CLI_ERRORS = [([*_TRAIN, "{" + name + "}"], words) for name, (_, words) in CRAFTED.items()]


def test_train_resume_refuses_each_crafted_checkpoint_in_one_line(good, tmp_path):
    from tensorpar.models.tiny import make_tiny_checkpoint
    dirs = crafted_checkpoints(tmp_path, good)
    dirs["llama"] = str(make_tiny_checkpoint(tmp_path / "llama", "llama"))
    argvs = [[a.format(**dirs) for a in argv] for argv, _ in CHECKPOINT_CLI_ERRORS]
    from tests._cli_batch import run_all  # tensorpar.cli.main as the entry point calls it, in this process
    for (argv, words), res in zip(CHECKPOINT_CLI_ERRORS, run_all(argvs)):
        lines = res["stderr"].strip().splitlines()
        assert res["rc"] == 2 and not res["stdout"] and len(lines) == 1 and words in lines[0], (argv[-1], res)
    assert not any(tmp_path.rglob(MARKER))

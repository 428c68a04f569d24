"""`mm_oval.files`: the one atomic writer every part of the project uses (results, traces, checkpoints,
agents' tables, the bundled data, benchmark JSON)."""

import json

import pytest

from mm_oval.files import atomic_write_bytes, atomic_write_json, atomic_write_text, remove_stale_tmp


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "new" / "folder" / "results.json"
    atomic_write_json(path, {"accuracy": 0.5, "name": "café"})
    assert json.loads(path.read_text(encoding="utf-8")) == {"accuracy": 0.5, "name": "café"}
    assert path.read_text(encoding="utf-8").endswith("}\n")
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]


class _Unwritable:
    def __len__(self) -> int:
        return 3


def test_a_failed_write_keeps_the_previous_version_and_cleans_up(tmp_path):
    path = tmp_path / "agents.bin"
    atomic_write_bytes(path, b"old")
    with pytest.raises(TypeError):
        atomic_write_bytes(path, _Unwritable())  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["agents.bin"]


def test_stale_temporary_files_of_a_killed_writer_are_removed_and_nothing_else(tmp_path):
    (tmp_path / ".results.json.0123456789ab.tmp").write_text("half")
    (tmp_path / "notes.tmp").write_text("the user's own file")
    assert remove_stale_tmp(tmp_path) == [".results.json.0123456789ab.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]


@pytest.mark.parametrize(
    "command, args",
    [
        ("train-kvp", ["--model", "bundled", "--data", "zoo:train:4"]),
        ("train-router", []),
        ("train-smol", []),
    ],
)
def test_a_training_command_refuses_an_output_folder_another_run_holds(command, args, tmp_path, capsys):
    """A second training run into a folder that a run holds stops at once with a clear error naming the
    holder, before it loads a model or writes anything; once the holder ends, the folder is free."""
    import os

    from mm_oval.cli import main
    from mm_oval.files import FolderLock

    out = tmp_path / "run"
    with FolderLock(out):
        assert main([command, "--out", str(out), *args]) == 2
        err = capsys.readouterr().err
        assert f"mm-oval {command}: error: {out} is in use by another run (pid {os.getpid()} on " in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    with FolderLock(out) as lock:  # released: the next run gets it
        assert lock.path.read_text().startswith(f"pid {os.getpid()} ")

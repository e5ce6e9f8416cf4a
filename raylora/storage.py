"""Where a path points: a local path, or a URI of any pyarrow filesystem (s3://, gs://, file://); and
what Ray Train recorded in a run's folder.

Local paths are made absolute once, when the config is loaded on the driver: the workers run on other
nodes, in other working directories, and must find the same folder.
"""

from __future__ import annotations

import json
import os
import posixpath

import pyarrow.fs


def is_uri(path: str) -> bool:
    """Whether `path` names a pyarrow filesystem URI rather than a local path."""
    return "://" in path


def absolute(path: str) -> str:
    """A local path made absolute (against this process's working directory); a URI as it is."""
    return path if is_uri(path) else os.path.abspath(path)


def filesystem(path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The pyarrow filesystem that holds `path` (a local path or a URI), and the path within it."""
    if is_uri(path):
        return pyarrow.fs.FileSystem.from_uri(path)
    return pyarrow.fs.LocalFileSystem(), str(path)


def run_folder(storage_path: str, name: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem and path of a run's folder `{storage_path}/{name}`."""
    fs, root = filesystem(storage_path)
    return fs, posixpath.join(root, name)


# Ray Train's record of the checkpoints a run reported; a run with the same name resumes from it.
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def _recorded_results(fs: pyarrow.fs.FileSystem, run_dir: str) -> list[dict] | None:
    """The checkpoint results Ray's snapshot lists (each with `checkpoint_dir_name` and the reported
    `metrics`); None when the snapshot exists but does not read."""
    path = posixpath.join(run_dir, RAY_SNAPSHOT)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return []
    try:
        with fs.open_input_stream(path) as f:
            snapshot = json.loads(f.read())
        results = [
            *snapshot.get("checkpoint_results", []),
            *snapshot.get("pending_training_results", []),
            snapshot.get("latest_checkpoint_result") or {},
        ]
        return [r for r in results if r and r["checkpoint_dir_name"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def recorded_checkpoints(fs: pyarrow.fs.FileSystem, run_dir: str) -> set[str] | None:
    """Folder names of the checkpoints Ray's snapshot lists; None when it exists but does not read."""
    results = _recorded_results(fs, run_dir)
    return None if results is None else {r["checkpoint_dir_name"] for r in results}


def recorded_steps(fs: pyarrow.fs.FileSystem, run_dir: str) -> set[int]:
    """The steps of the checkpoints Ray's snapshot lists (from the metrics reported with them)."""
    return {int(r.get("metrics", {}).get("step", -1)) for r in _recorded_results(fs, run_dir) or []}

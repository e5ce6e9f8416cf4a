"""Where a path points: a local path, or a URI of any pyarrow filesystem (s3://, gs://, file://).

Local paths are made absolute once, when the config is loaded on the driver: the workers run on other
nodes, in other working directories, and must find the same folder.
"""

from __future__ import annotations

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

"""Checks of EngineSettings that need no model: run before anything is loaded, so a bad setting fails in the first
second with one line instead of after minutes of loading (or, under `serve`, after the server started). `moeserve`
imports only the chosen subcommand's module, so a bad choice or path is refused before torch is even imported.

`check_engine_settings(settings)` raises ConfigError / CheckpointError naming the setting. It reads no weight and
imports no torch: the model folder is only resolved (a folder, or an id in the local Hugging Face cache), files
named by settings are checked to exist (or, for outputs, that their folder can be written), and names are checked
against their registries.
"""

from __future__ import annotations

import os
from pathlib import Path

from moeserve.config import EngineSettings, did_you_mean
from moeserve.errors import ConfigError


def check_engine_settings(s: EngineSettings, config_file_ok: bool = False) -> None:
    """Raise a one-line error for the first setting that cannot work; see the module docstring. The model folder
    comes last: finding it imports torch (moeserve.checkpoint), seconds on a busy machine; the rest does not.
    `config_file_ok`: a model given as a JSON config file is accepted (sized without weights by `plan`)."""
    from moeserve.experts.policies import ONLINE_POLICY_NAMES

    if s.cache_policy not in ONLINE_POLICY_NAMES:
        hint = did_you_mean(s.cache_policy, list(ONLINE_POLICY_NAMES))
        raise ConfigError(f"unknown cache_policy '{s.cache_policy}'{hint}")
    if s.cache_policy == "static" and s.cache_trace is None:
        raise ConfigError("cache_policy=static pins the most used experts of a recorded trace: set cache_trace=FILE "
                          "(record one with record_trace=FILE)")
    if s.tokenizer is not None and not Path(s.tokenizer).expanduser().is_dir():
        raise ConfigError(f"tokenizer={s.tokenizer}: no such folder")
    for name in ("chat_template", "cache_trace"):
        value = getattr(s, name)
        if value is not None:
            check_readable_file(name, value)
    if s.record_trace is not None:
        check_writable_file("record_trace", s.record_trace)
    if s.int8_cache_dir not in (None, "off"):
        check_writable_folder("int8_cache_dir", s.int8_cache_dir)
    if s.model is not None and not (config_file_ok and Path(s.model).expanduser().is_file()
                                    and s.model.endswith(".json")):
        from moeserve.checkpoint.folder import resolve_model_path

        resolve_model_path(s.model)


def check_readable_file(name: str, value: str) -> None:
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"{name}={value}: {'a folder, not a file' if path.is_dir() else 'no such file'}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{name}={value}: not readable (permission denied)")


def check_writable_file(name: str, value: str) -> None:
    """The file can be created or overwritten: its folder exists and is writable, and it is not a folder. Nothing
    is created here (a run that fails later leaves no empty file behind)."""
    path = Path(value).expanduser()
    if path.is_dir():
        raise ConfigError(f"{name}={value}: a folder, not a file")
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"{name}={value}: the folder {folder} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{name}={value}: the file is not writable (permission denied)")
    if not path.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}={value}: cannot create a file in {folder} (permission denied)")


def check_writable_folder(name: str, value: str) -> None:
    """The folder exists and is writable, or its nearest existing parent is (it will be created)."""
    path = Path(value).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(f"{name}={value}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}={value}: cannot write in {existing} (permission denied)")

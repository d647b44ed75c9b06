"""osdp-platform: recipes in, OSDP-planned FSDP2 training on Ray out, tracked in MLflow.

This folder is the package `osdp_platform`. When the repository root is on sys.path (a Python
started there: `python -m ...`, a spawned child, a Ray worker) the name `platform` would find this
folder before the standard library; in that case hand the import over to the standard module.
"""

if __name__ == "platform":
    import importlib.util as _util
    import sys as _sys
    import sysconfig as _sysconfig
    from pathlib import Path as _Path

    _spec = _util.spec_from_file_location("platform", _Path(_sysconfig.get_path("stdlib")) / "platform.py")
    assert _spec is not None and _spec.loader is not None
    _stdlib = _util.module_from_spec(_spec)
    _sys.modules["platform"] = _stdlib
    _spec.loader.exec_module(_stdlib)
else:
    __version__ = "0.1.0"

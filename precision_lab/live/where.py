"""Where in the user's code an op was called: the first frame outside torch, Python's standard library and
Precision Lab.  Libraries in site-packages count as the user's: a ``transformers`` model's op is located in
its modeling file, not at the training loop's call of the model.

The answer is cached per code object and line, so a call site costs one
walk up a few frames and dictionary look-ups, never string work per call.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from typing import Optional

import torch

from ..records import code_location

__all__ = ["user_location"]


def _folders(*paths) -> tuple[str, ...]:
    return tuple(sorted({os.path.abspath(p).rstrip(os.sep) + os.sep for p in paths if p}))


def _site_folders() -> tuple[str, ...]:
    paths = [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")]
    try:
        paths += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site module
        pass
    return _folders(*paths)


# torch's and ours, wherever they are installed
_OURS = _folders(os.path.dirname(os.path.abspath(torch.__file__)),
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the precision_lab package
# Python's own library.  The site-packages inside it hold the user's libraries: a transformers model's op is
# located in its modeling file, where the user can read it, not at the training loop's call of the model.
_STDLIB = _folders(sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib"))
_SITE = _site_folders()
# Keyed by the code object's id, with the code object kept in the value so that the id is never reused: code
# objects compare equal by their contents, not their file, so two libraries' identical functions (transformers
# copies one model's MLP into another's modeling file) would share one entry and one file name.
_INTERNAL: dict = {}  # id(code) -> (code, whether it is torch's, Python's or ours)
_SHOWN: dict = {}  # (id(code), line) -> (code, "file.py:line in function")


def _is_internal(code) -> bool:
    hit = _INTERNAL.get(id(code))
    if hit is not None:
        return hit[1]
    fn = code.co_filename
    if fn.startswith("<"):
        got = True
    else:
        p = os.path.abspath(fn)
        got = p.startswith(_OURS) or (p.startswith(_STDLIB) and not p.startswith(_SITE))
    _INTERNAL[id(code)] = (code, got)
    return got


def _shown(code, line: int) -> str:
    """Relative to the working folder when the file is under it, else by its last three parts."""
    filename = code.co_filename
    try:
        rel = os.path.relpath(filename)
        if not rel.startswith(".."):
            return f"{rel}:{line} in {code.co_name}"
    except ValueError:  # another drive
        pass
    return code_location(filename, line, code.co_name)


def user_location(skip: int = 1, depth: int = 64) -> Optional[str]:
    """``"path.py:LINE in FUNCTION"`` of the nearest caller outside torch, Python and Precision Lab, or None."""
    try:
        f = sys._getframe(skip + 1)
    except ValueError:
        return None
    n = 0
    while f is not None and n < depth:
        code = f.f_code
        if not _is_internal(code):
            key = (id(code), f.f_lineno)
            hit = _SHOWN.get(key)
            if hit is None:
                hit = _SHOWN[key] = (code, _shown(code, f.f_lineno))
            return hit[1]
        f = f.f_back
        n += 1
    return None

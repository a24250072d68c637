"""Analysis files: the sensitivities pickle and the paths of the files beside it (sidecar, ratios YAML).

The pickle holds PaddleSlim's structure, ``{param name: {ratio: relative loss}}``, so files move freely between
PaddleSlim and this tool. It is read with a restricted unpickler because an analysis file is data, never code:
only dicts, strings and numbers (plus the numpy scalars PaddleSlim often writes) can come out of it.
"""

from __future__ import annotations

import io
import json
import logging
import math
import numbers
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from analysis.errors import AnalysisFileError
from analysis.io.atomic import atomic_write_bytes, atomic_write_text
from analysis.ratio import normalise_ratio

logger = logging.getLogger(__name__)

Sensitivities = dict[str, dict[float, float]]
"""Parameter name -> {pruned ratio: relative loss}, exactly PaddleSlim's structure."""

PICKLE_PROTOCOL = 4
"""Fixed so that equal content always gives byte-identical files (resume compares bytes)."""

_STRUCTURE_HINT = "analysis files contain only dicts of numbers, {param name: {ratio: loss}}"


def sidecar_path(analysis_file: str | os.PathLike[str]) -> Path:
    """Return the JSON sidecar path of an analysis file: ``s.pkl`` -> ``s.pkl.json``."""
    path = Path(analysis_file)
    return path.with_name(path.name + ".json")


def ratios_path(analysis_file: str | os.PathLike[str]) -> Path:
    """Return the ratios YAML path of an analysis file: ``s.pkl`` -> ``s.pkl.ratios.yaml``."""
    path = Path(analysis_file)
    return path.with_name(path.name + ".ratios.yaml")


# --------------------------------------------------------------------------------------------------- atomic writes


# ------------------------------------------------------------------------------------------- restricted unpickling


class _Forbidden(Exception):
    """The pickle asks for something an analysis file never needs (a global, a persistent id, an odd dtype)."""


class _DtypeStandIn:
    """Takes numpy.dtype's place while unpickling: keeps only a type code and a byte order, never numpy state."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.byteorder = "="

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">", "|", "=")):
            _forbid("a malformed numpy dtype")
        self.byteorder = state[1]


def _safe_dtype(spec: Any, align: Any = False, copy: Any = False) -> _DtypeStandIn:
    """Accept ``numpy.dtype("f8", False, True)`` and the like for boolean, integer and float types only."""
    import numpy as np

    if not isinstance(spec, str) or np.dtype(spec).kind not in "biuf":
        _forbid(f"a numpy dtype {spec!r}")
    return _DtypeStandIn(spec)


def _numpy_scalar_factory() -> Callable[..., Any]:
    import numpy as np

    try:
        from numpy._core.multiarray import scalar  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import scalar  # type: ignore[no-redef]

    def safe_scalar(spec: Any, data: Any = None) -> Any:
        if not isinstance(spec, _DtypeStandIn):
            _forbid(f"a numpy scalar of type {type(spec).__name__}")
        dtype = np.dtype(spec.code)
        if spec.byteorder in "<>":
            dtype = dtype.newbyteorder(spec.byteorder)  # type: ignore[arg-type]  # "<" or ">", checked above
        if isinstance(data, str):  # Python 2 pickles, loaded with encoding="latin1"
            data = data.encode("latin1")
        if not isinstance(data, bytes) or len(data) != dtype.itemsize:
            _forbid(f"a malformed numpy {dtype} scalar")
        return scalar(dtype, data)

    return safe_scalar


def _safe_codecs_encode(text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
    """Protocol 0-2 pickles spell the bytes of a numpy scalar as ``_codecs.encode(text, "latin1")``."""
    if not isinstance(text, str) or str(encoding).lower().replace("-", "") != "latin1" or errors != "strict":
        _forbid("_codecs.encode with unexpected arguments")
    return text.encode("latin1")


def _forbid(what: str) -> NoReturn:
    raise _Forbidden(what)


# Exactly the globals needed to rebuild numpy int/float scalars (checked by pickling them with protocols 0-5).
_ALLOWED_GLOBALS: dict[tuple[str, str], Callable[[], Callable[..., Any]]] = {
    ("numpy.core.multiarray", "scalar"): _numpy_scalar_factory,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar_factory,
    ("numpy", "dtype"): lambda: _safe_dtype,
    ("_codecs", "encode"): lambda: _safe_codecs_encode,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves no globals except guarded numpy scalar builders, so it never runs code."""

    def find_class(self, module: str, name: str) -> Any:
        factory = _ALLOWED_GLOBALS.get((module, name))
        if factory is None:
            _forbid(f"{module}.{name}")
        return factory()

    def persistent_load(self, pid: Any) -> NoReturn:
        _forbid("a persistent id (torch.save or another framework's format)")


def load_sensitivities(path: str | os.PathLike[str]) -> Sensitivities:
    """Load an analysis file written by this tool or by PaddleSlim.

    Args:
        path: The pickle file. A missing file gives ``{}`` so that a fresh analysis and a resumed one start alike.

    Returns:
        ``{param: {ratio: loss}}`` with ratio keys normalised by :func:`normalise_ratio` and every number a plain
        Python float; parameter order is the file's.

    Raises:
        AnalysisFileError: The file is unreadable, is not a pickle, references code or unexpected types, or does
            not have the ``{str: {number: finite number}}`` structure.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise AnalysisFileError(
            f"Analysis file {path} cannot be read ({error.strerror or error}); check the path and its permissions."
        ) from None
    data = _unpickle(raw, path)
    try:
        return _validated(data, duplicate_note=f" in {path}")
    except ValueError as error:
        raise AnalysisFileError(
            f"Analysis file {path} has the wrong structure ({error}); {_STRUCTURE_HINT}, so regenerate it or pass "
            "the right file."
        ) from None


def _unpickle(raw: bytes, path: Path) -> Any:
    stream = io.BytesIO(raw)
    try:
        data = _RestrictedUnpickler(stream, encoding="latin1").load()
    except _Forbidden as error:
        raise AnalysisFileError(
            f"Analysis file {path} holds code or unexpected types ({error}) and was not loaded; {_STRUCTURE_HINT}, "
            "so use a file written by this tool or PaddleSlim's sensitivity()."
        ) from None
    except Exception as error:  # any failure while parsing bytes means the file is not a (complete) pickle
        reason = "it is empty" if not raw else f"{type(error).__name__}: {error}"
        raise AnalysisFileError(
            f"Analysis file {path} is not a pickle or is damaged ({reason}); pass a file written by this tool or "
            "PaddleSlim's sensitivity(), or delete it to start the analysis afresh."
        ) from None
    if stream.tell() != len(raw):
        raise AnalysisFileError(
            f"Analysis file {path} is not a pickle or is damaged (unexpected bytes after the pickle's end); pass a "
            "file written by this tool or PaddleSlim's sensitivity(), or delete it to start the analysis afresh."
        )
    return data


# ------------------------------------------------------------------------------------------------ structure checks


def _finite_number(value: Any) -> float | None:
    """Return ``value`` as a float when it is a finite real number (bools excluded), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _validated(data: Any, duplicate_note: str = "") -> Sensitivities:
    """Return a fresh, normalised copy of ``data``; raise ValueError describing the first bad entry."""
    if not isinstance(data, Mapping):
        raise ValueError(f"the top level is a {type(data).__name__}, not a dict")
    clean: Sensitivities = {}
    for param, curve in data.items():
        if not isinstance(param, str):
            raise ValueError(f"key {param!r} is a {type(param).__name__}, not a parameter name string")
        if not isinstance(curve, Mapping):
            raise ValueError(f"entry {param!r} is a {type(curve).__name__}, not a {{ratio: loss}} dict")
        points: dict[float, float] = {}
        for ratio, loss in curve.items():
            ratio_value = _finite_number(ratio)
            if ratio_value is None:
                raise ValueError(f"entry {param!r} has ratio {ratio!r}, which is not a finite number")
            loss_value = _finite_number(loss)
            if loss_value is None:
                raise ValueError(f"entry {param!r} at ratio {ratio!r} has loss {loss!r}, which is not a finite number")
            key = normalise_ratio(ratio_value)
            if key in points and points[key] != loss_value:
                logger.warning(
                    "Ratios of %s that round to %s carry different losses%s; keeping the later one (%s).",
                    param,
                    key,
                    duplicate_note,
                    loss_value,
                )
            points[key] = loss_value
        clean[param] = dict(sorted(points.items()))
    return clean


# ------------------------------------------------------------------------------------------------- save and merge


def save_sensitivities(path: str | os.PathLike[str], sensitivities: Mapping[str, Mapping[float, float]]) -> None:
    """Write an analysis file atomically, in a byte-stable form PaddleSlim can read.

    Parameters keep the given order (callers pass model order); ratios are normalised and sorted ascending; every
    number is a plain float; the pickle protocol is fixed, so equal content always gives identical bytes.

    Raises:
        ValueError: ``sensitivities`` is not ``{str: {number: finite number}}``; that is a bug in the caller, and a
            file that :func:`load_sensitivities` would refuse is never written.
    """
    data = pickle.dumps(_validated(sensitivities), protocol=PICKLE_PROTOCOL)
    atomic_write_bytes(path, data)


def merge_sensitive(sources: Sequence[Mapping[str, Mapping[float, float]] | str | os.PathLike[str]]) -> Sensitivities:
    """Merge several sensitivities (dicts or analysis files) with PaddleSlim's semantics.

    Later sources win for the same (param, ratio); parameters keep the order of their first appearance and each
    parameter's ratios are sorted.

    Raises:
        ValueError: ``sources`` is empty.
        TypeError: ``sources`` is a single path rather than a sequence of sources.
        AnalysisFileError: A path cannot be loaded (see :func:`load_sensitivities`).
    """
    if isinstance(sources, (str, bytes, os.PathLike)):
        raise TypeError("merge_sensitive takes a sequence of sources; wrap a single path in a list.")
    if not sources:
        raise ValueError("merge_sensitive needs at least one source.")
    merged: Sensitivities = {}
    for source in sources:
        current = _validated(source) if isinstance(source, Mapping) else load_sensitivities(source)
        for param, curve in current.items():
            merged.setdefault(param, {}).update(curve)
    return {param: dict(sorted(curve.items())) for param, curve in merged.items()}


def copy_analysis(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Copy an analysis file and its sidecar byte for byte (either may be missing), each atomically: the sidecar
    first and the pickle last, as the store saves them (e.g. to start a shard from what is done)."""
    source, target = Path(source), Path(target)
    if sidecar_path(source).exists():
        atomic_write_bytes(sidecar_path(target), sidecar_path(source).read_bytes())
    if source.exists():
        atomic_write_bytes(target, source.read_bytes())


# ------------------------------------------------------------------------------------------------------- sidecar


def save_sidecar(analysis_file: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write a raw JSON sidecar of ``analysis_file`` atomically (indent 2, UTF-8, trailing newline); the package
    writes typed records with :func:`analysis.io.sidecar.save`.

    Raises:
        ValueError: ``data`` holds NaN or infinity (refused so the file stays strict JSON).
        TypeError: ``data`` holds something JSON cannot represent. Both are bugs in the caller, not user errors.
    """
    atomic_write_text(sidecar_path(analysis_file), sidecar_text(data))


def sidecar_text(data: Mapping[str, Any]) -> str:
    """A sidecar's JSON text: indent 2, UTF-8 characters as they are, a trailing newline.

    Raises:
        ValueError: ``data`` holds NaN or infinity (refused so the file stays strict JSON).
    """
    return json.dumps(data, indent=2, allow_nan=False, ensure_ascii=False) + "\n"


def load_sidecar(analysis_file: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Return the JSON sidecar of ``analysis_file`` as parsed (a dict), or ``None`` when there is none; the package
    reads it validated and typed with :func:`analysis.io.sidecar.load`.

    Raises:
        AnalysisFileError: The sidecar is unreadable, not strict UTF-8 JSON, or not a JSON object.
    """
    path = sidecar_path(analysis_file)
    advice = "fix or delete it (it is rewritten on the next run)"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise AnalysisFileError(f"Sidecar file {path} is not UTF-8 text; {advice}.") from None
    except OSError as error:
        raise AnalysisFileError(f"Sidecar file {path} cannot be read ({error.strerror or error}); {advice}.") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise AnalysisFileError(
            f"Sidecar file {path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
            f"{advice}."
        ) from None
    except ValueError as error:
        raise AnalysisFileError(f"Sidecar file {path} is not valid JSON ({error}); {advice}.") from None
    if not isinstance(data, dict):
        raise AnalysisFileError(f"Sidecar file {path} holds a JSON {type(data).__name__}, not an object; {advice}.")
    return data


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


# ----------------------------------------------------------------------------------------------------------- CSV

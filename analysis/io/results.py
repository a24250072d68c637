"""Analysis files: the sensitivities pickle, its JSON sidecar, the ratios YAML path and CSV exports, all atomic.

The pickle holds PaddleSlim's structure, ``{param name: {ratio: relative loss}}``, so files move freely between
PaddleSlim and this tool. It is read with a restricted unpickler because an analysis file is data, never code:
only dicts, strings and numbers (plus the numpy scalars PaddleSlim often writes) can come out of it.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
import logging
import math
import numbers
import os
import pickle
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from analysis.config import RATIO_DECIMALS
from analysis.errors import AnalysisFileError

if TYPE_CHECKING:
    from analysis.io.sidecar import Sidecar, VariantRecord

logger = logging.getLogger(__name__)

Sensitivities = dict[str, dict[float, float]]
"""Parameter name -> {pruned ratio: relative loss}, exactly PaddleSlim's structure."""

PICKLE_PROTOCOL = 4
"""Fixed so that equal content always gives byte-identical files (resume compares bytes)."""

_STRUCTURE_HINT = "analysis files contain only dicts of numbers, {param name: {ratio: loss}}"


def normalise_ratio(ratio: float) -> float:
    """Return ``ratio`` rounded to 6 decimals, so that 0.3 and 0.30000000000000004 are one key."""
    return round(float(ratio), RATIO_DECIMALS)


def sidecar_path(analysis_file: str | os.PathLike[str]) -> Path:
    """Return the JSON sidecar path of an analysis file: ``s.pkl`` -> ``s.pkl.json``."""
    path = Path(analysis_file)
    return path.with_name(path.name + ".json")


def ratios_path(analysis_file: str | os.PathLike[str]) -> Path:
    """Return the ratios YAML path of an analysis file: ``s.pkl`` -> ``s.pkl.ratios.yaml``."""
    path = Path(analysis_file)
    return path.with_name(path.name + ".ratios.yaml")


# --------------------------------------------------------------------------------------------------- atomic writes


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see either the old or the new file, never a partial one.

    The bytes go to a uniquely named temporary file in the same directory, which is flushed and fsynced, renamed
    over the target with ``os.replace`` and made durable by fsyncing the directory. Parent directories are
    created. If anything fails the temporary file is removed and the previous file is left untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    # os.open applies the umask like a plain open() would; O_EXCL guarantees the name is ours alone.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_directory(target.parent)


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files a killed :func:`atomic_write_bytes` of ``path`` left behind; returns them.

    Only safe while holding the file's lock (no live writer can own them)."""
    target = Path(path)
    stale = sorted(target.parent.glob(f".{glob.escape(target.name)}.*.tmp"))
    for temp in stale:
        with contextlib.suppress(OSError):
            temp.unlink()
    return stale


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` as UTF-8 with :func:`atomic_write_bytes`; newlines are written exactly as given."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _fsync_directory(directory: Path) -> None:
    """Persist a rename; some platforms (Windows) and filesystems cannot fsync a directory, which is harmless."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        logger.debug("Could not fsync directory %s: %s", directory, error)
    finally:
        os.close(fd)


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

CSV_STYLES = ("wide", "long")
LONG_COLUMNS = ("parameter", "sparsity", "top1", "top5", "loss", "relative_loss", "macs", "params",
                "macs_reduction", "params_reduction")  # fmt: skip


def csv_path(analysis_file: str | os.PathLike[str], style: str) -> Path:
    """Return the CSV export path of an analysis file: ``s.pkl`` -> ``s.wide.csv`` / ``s.long.csv``."""
    path = Path(analysis_file)
    return path.with_name(f"{path.stem}.{style}.csv")


def export_csv(
    analysis_file: str | os.PathLike[str], path: str | os.PathLike[str] | None = None, style: str = "wide"
) -> Path:
    """Export an analysis file (and its sidecar) as CSV, atomically; returns the path written.

    ``wide`` is NNI's ``SensitivityAnalysis.export`` format: a header ``layername,<ratio>,...`` and one row per
    conv (module name) holding the evaluated metric (``top1`` by default) at each ratio; it needs the sidecar.
    ``long`` is Distiller's ``sensitivities_to_csv`` format, ``parameter,sparsity,top1,top5,loss`` with top1/top5
    in percent, ``loss`` the cross-entropy and a 0.0 row holding the baseline for each parameter, followed by our
    ``relative_loss`` (the number in the analysis file) and the variant's MACs and params after physical removal
    with their reductions (empty when the sidecar lacks them). Parameters follow the file's (model) order and
    ratios ascend, so equal inputs give byte-identical files. With adaptive BN (BatchNorm statistics re-estimated
    per variant) the metric columns are suffixed ``_adaptive_bn`` (``layername_adaptive_bn``, ``top1_adaptive_bn``).

    Raises:
        AnalysisFileError: The analysis file or its sidecar cannot be read, or ``wide`` is asked without a sidecar.
        ValueError: ``style`` is not ``wide`` or ``long``.
    """
    from analysis.io import sidecar as schema  # the schema builds on this module

    if style not in CSV_STYLES:
        raise ValueError(f"style must be one of {CSV_STYLES}, got {style!r}")
    sensitivities = load_sensitivities(analysis_file)
    sidecar = schema.load(analysis_file)
    if style == "wide":
        if sidecar is None:
            raise AnalysisFileError(
                f"The wide (NNI) CSV holds metric values, which live in the sidecar {sidecar_path(analysis_file)}; "
                "it is missing, so export style='long' instead."
            )
        rows = _wide_rows(sensitivities, sidecar)
    else:
        rows = _long_rows(sensitivities, sidecar or schema.Sidecar())
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    target = Path(path) if path is not None else csv_path(analysis_file, style)
    atomic_write_text(target, buffer.getvalue())
    return target


def _wide_rows(sensitivities: Sensitivities, sidecar: Sidecar) -> list[list[Any]]:
    metric = sidecar.settings.metric_name
    ratios = sorted({ratio for curve in sensitivities.values() for ratio in curve})
    rows: list[list[Any]] = [[_marked("layername", sidecar), *ratios]]
    for name, curve in sensitivities.items():
        values = [_value(sidecar.variant(name, ratio), metric) if ratio in curve else "" for ratio in ratios]
        rows.append([name.removesuffix(".weight"), *values])
    return rows


def _value(variant: VariantRecord | None, metric: str) -> Any:
    return _blank(None if variant is None else variant.metric(metric))


ADAPTIVE_BN_SUFFIX = "_adaptive_bn"


def _marked(column: str, sidecar: Sidecar) -> str:
    """A metric column's name, suffixed when the analysis re-estimated BatchNorm per variant (adaptive BN), so its
    numbers are never mistaken for plain ones."""
    return column + ADAPTIVE_BN_SUFFIX if sidecar.settings.adaptive_bn else column


def _long_rows(sensitivities: Sensitivities, sidecar: Sidecar) -> list[list[Any]]:
    dense = sidecar.cost
    dense_costs = (dense.macs, dense.params, 0.0, 0.0) if dense is not None and dense.macs is not None else ()
    measured = ("top1", "top5", "loss", "relative_loss")  # measured after BatchNorm re-estimation with adaptive BN
    rows: list[list[Any]] = [[_marked(c, sidecar) if c in measured else c for c in LONG_COLUMNS]]
    for name, curve in sensitivities.items():
        rows.append(_long_row(name, 0.0, sidecar.baseline or {}, 0.0, dense_costs))
        for ratio, loss in curve.items():
            variant = sidecar.variant(name, ratio)
            if variant is None:
                rows.append(_long_row(name, ratio, {}, loss, ()))
                continue
            costs = (variant.macs, variant.params, variant.macs_reduction, variant.params_reduction)
            rows.append(_long_row(name, ratio, variant.metrics, loss, costs))
    return rows


def _long_row(
    name: str, sparsity: float, metrics: Mapping[str, float], loss: float, costs: Sequence[float | None]
) -> list[Any]:
    def percent(value: float | None) -> Any:
        return "" if value is None else round(100.0 * value, 10)

    cost_cells = [_blank(value) for value in costs] or [""] * 4
    return [name, sparsity, percent(metrics.get("top1")), percent(metrics.get("top5")), _blank(metrics.get("ce")),
            loss, *cost_cells]  # fmt: skip


def _blank(value: Any) -> Any:
    """A CSV cell: empty for a missing value."""
    return "" if value is None else value

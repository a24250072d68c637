#!/usr/bin/env python
"""Model coverage: does every torchvision classifier and a wide set of timm architectures analyse its units?

Each model runs in its own child process with a wall-clock timeout, one torch thread by default:

1. **build**: random weights (nothing is downloaded), random BatchNorm statistics, eval mode, the smallest input
   size from a fixed list at which the model runs (ViT/Swin/MaxViT-style models are built for that size with their
   ``img_size``/``image_size``/``input_size`` argument);
2. **discovery**: ``analysis.find_prunable(model, example_input)``, timed on its own, units counted by kind and
   the reasons of the units left out grouped with counts;
3. **engines**: ``analysis.analysis_prune`` on a few random images with random labels (``--metric ce``), one
   ratio, every unit kind the package knows, with the reference engine and with the fast engine; from the analysis
   files and sidecars: units analysed, units skipped by the engine (with its reason), units selected but absent
   from the results without a reason ("dropped", must be 0), mask/physical/failed-physical counts, and the largest
   difference between the engines.

A hang is stopped at the timeout (the child's Python stacks are dumped first and kept in the record) and a hard
crash is recorded with the end of its stderr; the sweep goes on. One JSON record per model is appended to
``--out`` (``benchmarks/_data/coverage.jsonl``, git-ignored); ``--resume`` skips the models already there.

    python benchmarks/coverage.py --models resnet18 mobilenet_v3_small          # torchvision and timm names
    python benchmarks/coverage.py --source timm --models 'vit_*' --engines none  # discovery only
    python benchmarks/coverage.py --print-only                                   # the table of the records so far
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("analysis") is None:  # not installed: use the source tree this script lives in
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "_data" / "coverage.jsonl"
SIZES = (64, 96, 112, 128, 160, 192, 224, 256, 299)  # input sizes tried, smallest first
NUM_CLASSES = 10
ENGINES = ("reference", "fast")

# timm architectures: (family, model name), the smallest variant of each family in timm 1.0.
TIMM_MODELS: tuple[tuple[str, str], ...] = (
    ("ResNet", "resnet18"),
    ("ResNet", "resnet10t"),
    ("SE-ResNet", "seresnet18"),
    ("SE-ResNeXt", "seresnext26d_32x4d"),
    ("ResNeXt", "resnext26ts"),
    ("EfficientNet", "efficientnet_b0"),
    ("EfficientNet-Lite", "efficientnet_lite0"),
    ("EfficientNetV2", "tf_efficientnetv2_b0"),
    ("MobileNetV3", "mobilenetv3_small_100"),
    ("MobileNetV4", "mobilenetv4_conv_small"),
    ("MobileNetV4 hybrid", "mobilenetv4_hybrid_medium"),
    ("MNASNet", "mnasnet_small"),
    ("FBNet", "fbnetc_100"),
    ("ConvNeXt", "convnext_atto"),
    ("ConvNeXt-V2", "convnextv2_atto"),
    ("RegNetX", "regnetx_002"),
    ("RegNetY", "regnety_002"),
    ("GhostNet", "ghostnet_100"),
    ("GhostNetV2", "ghostnetv2_100"),
    ("RepGhost", "repghostnet_050"),
    ("RepVGG", "repvgg_a0"),
    ("ReXNet", "rexnet_100"),
    ("LCNet", "lcnet_050"),
    ("HRNet", "hrnet_w18_small"),
    ("DLA", "dla34"),
    ("DenseNet", "densenet121"),
    ("CSPNet", "cspresnet50"),
    ("DPN", "dpn48b"),
    ("MixNet", "mixnet_s"),
    ("Res2Net", "res2net50_26w_4s"),
    ("ResNeSt", "resnest14d"),
    ("VGG", "vgg11"),
    ("Inception", "inception_v3"),
    ("Xception", "xception41"),
    ("GENet", "gernet_s"),
    ("SelecSLS", "selecsls42b"),
    ("EfficientViT (MIT)", "efficientvit_b0"),
    ("EfficientViT (MSRA)", "efficientvit_m0"),
    ("FastViT", "fastvit_t8"),
    ("MobileOne", "mobileone_s0"),
    ("MobileViT", "mobilevit_xxs"),
    ("EdgeNeXt", "edgenext_xx_small"),
    ("EfficientFormer", "efficientformer_l1"),
    ("LeViT", "levit_128s"),
    ("ViT", "vit_tiny_patch16_224"),
    ("DeiT", "deit_tiny_patch16_224"),
    ("Swin", "swin_tiny_patch4_window7_224"),
    ("PoolFormer", "poolformer_s12"),
    ("CoAtNet", "coatnet_nano_rw_224"),
    ("MaxViT", "maxvit_nano_rw_256"),
    ("NF-ResNet", "nf_resnet26"),
    ("NFNet", "nfnet_l0"),
    ("HGNet", "hgnet_tiny"),
    ("HGNetV2", "hgnetv2_b0"),
    ("VoVNet", "ese_vovnet19b_dw"),
)
# torchvision builders that take the input size as an argument (the model is built for the size it runs at)
TORCHVISION_SIZE_ARGS = {"vit_": "image_size", "maxvit_": "input_size"}


# ------------------------------------------------------------------------------------------------------ model list


@dataclass(frozen=True)
class ModelSpec:
    """One model of the sweep: where it comes from, its name and its family (timm) or builder (torchvision)."""

    source: str
    name: str
    family: str = ""

    @property
    def key(self) -> str:
        """``source:name``, the model's identity in the records."""
        return f"{self.source}:{self.name}"


def all_specs(source: str) -> list[ModelSpec]:
    """Every torchvision classification model and the timm list, as ``source`` selects."""
    specs: list[ModelSpec] = []
    if source in ("torchvision", "all"):
        import torchvision

        specs += [ModelSpec("torchvision", n) for n in torchvision.models.list_models(module=torchvision.models)]
    if source in ("timm", "all"):
        specs += [ModelSpec("timm", name, family) for family, name in TIMM_MODELS]
    return specs


def select_specs(specs: Sequence[ModelSpec], patterns: Sequence[str] | None) -> list[ModelSpec]:
    """The specs whose name or ``source:name`` matches one of the glob ``patterns`` (all without patterns)."""
    if not patterns:
        return list(specs)
    return [s for s in specs if any(fnmatch.fnmatchcase(s.name, p) or fnmatch.fnmatchcase(s.key, p) for p in patterns)]


def check_timm_names() -> list[str]:
    """Names of :data:`TIMM_MODELS` this timm does not have (the list is meant to exist in timm 1.0)."""
    import timm

    known = set(timm.list_models())
    return [name for _, name in TIMM_MODELS if name not in known]


# ------------------------------------------------------------------------------------------------------ the child


class RecordWriter:
    """The child's record, rewritten atomically after every step so a killed child still leaves what it found."""

    def __init__(self, path: Path, record: dict[str, Any]) -> None:
        self.path, self.record = path, record

    def update(self, **values: Any) -> None:
        """Set ``values`` and save the record."""
        self.record.update(values)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.record, default=str))
        os.replace(temporary, self.path)


@contextlib.contextmanager
def phase(writer: RecordWriter, name: str) -> Iterator[dict[str, Any]]:
    """Mark ``name`` as the running phase; an exception in it is recorded (type, message, where) and not raised."""
    writer.update(phase=name)
    info: dict[str, Any] = {"ok": False}
    start = time.perf_counter()
    try:
        yield info
        info["ok"] = True
    except Exception as error:  # every failure is a result of the sweep, never the end of it
        traceback.print_exc()
        info["error"] = describe_error(error)
        writer.record.setdefault("errors", {})[name] = info["error"]
    finally:
        info["seconds"] = round(time.perf_counter() - start, 3)
        writer.record.setdefault("phases", {})[name] = info["seconds"]
        writer.update()


def describe_error(error: BaseException) -> dict[str, str]:
    """Type, first line of the message, innermost frame and innermost frame in the ``analysis`` package."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f"{os.sep}analysis{os.sep}" in f.filename]
    where = [f for f in frames if not f.filename.endswith("coverage.py") and not f.filename.startswith("<")] or frames

    def at(frame: traceback.FrameSummary) -> str:
        return f"{short_path(frame.filename)}:{frame.lineno} {frame.name}"

    message = str(error).strip().splitlines()
    return {
        "type": type(error).__name__,
        "message": message[0][:300] if message else "",
        "where": at(where[-1]) if where else "",
        "ours": at(ours[-1]) if ours else "",  # innermost frame in the analysis package
    }


def short_path(filename: str) -> str:
    """A file name relative to the repository or to site-packages."""
    if "site-packages" in filename:
        return filename.split("site-packages" + os.sep, 1)[1]
    with contextlib.suppress(ValueError):
        return str(Path(filename).resolve().relative_to(REPO_ROOT))
    return filename


def build(spec: ModelSpec, size_arg: str | None, size: int | None) -> Any:
    """The model with random weights, built for ``size`` when the builder takes it as ``size_arg``."""
    kwargs: dict[str, Any] = {"num_classes": NUM_CLASSES}
    if size_arg is not None and size is not None:
        kwargs[size_arg] = (size, size) if size_arg == "input_size" else size
    if spec.source == "torchvision":
        import torchvision

        return torchvision.models.get_model(spec.name, weights=None, **kwargs)
    import timm

    return timm.create_model(spec.name, pretrained=False, **kwargs)


def size_argument(spec: ModelSpec) -> str | None:
    """The keyword that sets the input size the model is built for, if its builder has one."""
    if spec.source == "torchvision":
        return next((arg for prefix, arg in TORCHVISION_SIZE_ARGS.items() if spec.name.startswith(prefix)), None)
    try:
        build(spec, "img_size", SIZES[-1])
    except TypeError as error:
        if "img_size" in str(error):
            return None
    except Exception:  # another problem at this size: the size search reports it
        pass
    return "img_size"


def randomize_batchnorm(model: Any, seed: int) -> None:
    """Random BatchNorm statistics and affine parameters, so that no BatchNorm is an identity."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                channels = module.running_mean.shape
                module.running_mean.copy_(torch.rand(channels, generator=generator) - 0.5)
                module.running_var.copy_(torch.rand(channels, generator=generator) * 1.5 + 0.5)
                if module.affine:
                    module.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
                    module.bias.copy_(torch.rand(channels, generator=generator) - 0.5)


def runs_at(model: Any, size: int) -> str | None:
    """None when ``model`` maps a ``size`` x ``size`` image to logits, else why not."""
    import torch

    try:
        with torch.inference_mode():
            output = model(torch.randn(1, 3, size, size))
    except Exception as error:
        return f"{type(error).__name__}: {str(error).strip()[:200]}"
    if not isinstance(output, torch.Tensor) or output.shape != (1, NUM_CLASSES):
        return f"output is {type(output).__name__} {getattr(output, 'shape', '')}, not logits"
    return None


def build_smallest(spec: ModelSpec, sizes: Sequence[int], seed: int) -> tuple[Any, int, dict[str, Any]]:
    """The model built and run at the first of ``sizes`` that works, with that size and the build arguments."""
    import torch

    size_arg = size_argument(spec)
    model, failures = None, []
    for size in sizes:
        if size_arg is not None or model is None:
            torch.manual_seed(seed)
            try:
                model = build(spec, size_arg, size).eval()
            except Exception as error:
                failures.append(f"{size}: {type(error).__name__}: {str(error).strip()[:120]}")
                continue
        problem = runs_at(model, size)
        if problem is None:
            randomize_batchnorm(model, seed)
            return model, size, {size_arg: size} if size_arg else {}
        failures.append(f"{size}: {problem}")
    raise RuntimeError(f"no input size works ({'; '.join(failures[-3:])})")


class LogTally(logging.Handler):
    """Keeps what the engines log that matters here: fast-engine fallbacks and skipped units."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        """The messages since the last call."""
        taken, self.messages = self.messages, []
        return taken


def group_reasons(reasons: dict[str, str], module_names: set[str]) -> dict[str, int]:
    """Reasons with counts, module names in parentheses replaced by ``...`` so that like reasons group."""

    def general(reason: str) -> str:
        return re.sub(r"\(([^()]*)\)", lambda m: "(...)" if m.group(1) in module_names else m.group(0), reason)

    counts = Counter(general(r) for r in reasons.values())
    return dict(counts.most_common())


def evenly_spaced(names: Sequence[str], limit: int) -> list[str]:
    """All names, or ``limit`` of them spread evenly over the model, first and last included (limit 0: all)."""
    if limit <= 0 or limit >= len(names):
        return list(names)
    if limit == 1:
        return list(names[:1])
    step = (len(names) - 1) / (limit - 1)
    return [names[round(i * step)] for i in range(limit)]


def variant_values(sidecar: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """``(param, ratio key, value name) -> value`` of the loss and metrics of every variant in a sidecar."""
    values: dict[tuple[str, str, str], float] = {}
    for name, info in (sidecar.get("params") or {}).items():
        for ratio, variant in (info.get("variants") or {}).items():
            values[(name, ratio, "loss")] = variant["loss"]
            for key in ("top1", "top5", "ce"):
                if key in (variant.get("metrics") or {}):
                    values[(name, ratio, key)] = variant["metrics"][key]
    return values


def engine_result(path: Path, selected: Sequence[str], ratio: float, finished: bool) -> dict[str, Any]:
    """What one engine's analysis file says about the selected units (a run that raised has not dropped the units it
    did not reach: they are ``unfinished``)."""
    from analysis.io.results import load_sensitivities, load_sidecar

    losses = load_sensitivities(path)
    sidecar = load_sidecar(path) or {}
    analysed = [n for n in selected if any(math.isclose(r, ratio, abs_tol=1e-9) for r in losses.get(n, {}))]
    unprunable = sidecar.get("unprunable") or {}
    skipped = {n: unprunable[n] for n in selected if n not in analysed and n in unprunable}
    dropped = [n for n in selected if n not in analysed and n not in skipped]
    params = sidecar.get("params") or {}
    modes = Counter(str((params.get(n) or {}).get("mode")) for n in analysed)
    failed = [n for n, reason in skipped.items() if reason.startswith("physical pruning failed")]
    return {
        "analysed": len(analysed),
        "modes": dict(modes),
        "failed_physical": len(failed),
        "skipped": skipped,
        "dropped": dropped if finished else [],
        "unfinished": [] if finished else dropped,
        "baseline": sidecar.get("baseline"),
    }


def compare_engines(reference: Path, fast: Path) -> dict[str, Any]:
    """Whether both analysis files hold the same losses, and the largest difference of any loss or metric."""
    from analysis.io.results import load_sensitivities, load_sidecar

    same_losses = load_sensitivities(reference) == load_sensitivities(fast)
    ref_values, fast_values = (variant_values(load_sidecar(p) or {}) for p in (reference, fast))
    common = ref_values.keys() & fast_values.keys()
    diffs = [abs(ref_values[k] - fast_values[k]) for k in common]
    return {
        "equal": same_losses and ref_values.keys() == fast_values.keys(),
        "max_diff": max(diffs, default=0.0),
        "only_one": len(ref_values.keys() ^ fast_values.keys()),
    }


def child(args: argparse.Namespace) -> int:
    """Build, discover and analyse one model; the record at ``--record`` holds everything found so far."""
    import resource

    if args.memory_gb > 0:  # a model that would take the machine's memory fails with MemoryError instead
        limit = int(args.memory_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    torch.set_num_threads(args.threads)
    source, name = args.child.split(":", 1)
    families = {n: f for f, n in TIMM_MODELS} if source == "timm" else {}
    spec = ModelSpec(source, name, families.get(name, ""))
    writer = RecordWriter(Path(args.record), {"model": spec.key, "source": source, "name": name,
                                              "family": spec.family, "threads": args.threads})  # fmt: skip
    tally = LogTally()
    logging.getLogger("analysis").addHandler(tally)
    logging.getLogger("analysis").setLevel(logging.INFO)
    started = time.perf_counter()
    with phase(writer, "build") as built:
        model, size, build_args = build_smallest(spec, args.sizes or SIZES, args.seed)
        writer.update(size=size, build_args=build_args, parameters=sum(p.numel() for p in model.parameters()))
    if not built["ok"]:
        return finish(writer, started)

    import analysis

    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.images, 3, size, size, generator=generator)
    with phase(writer, "discovery") as found:
        units = analysis.find_prunable(model, images[: args.batch])
    writer.update(discovery_seconds=found["seconds"])
    if not found["ok"]:
        return finish(writer, started)
    module_names = {n for n, _ in model.named_modules()}
    kinds = unit_kinds(args.units)
    left_out = {u.name: u.reason or "" for u in units if not u.prunable}
    left_out.update({u.name: "kind not selected (--units)" for u in units if u.prunable and kind_of(u) not in kinds})
    prunable = [u.name for u in units if u.prunable and kind_of(u) in kinds]
    selected = evenly_spaced(prunable, args.max_units)
    writer.update(
        found=len(units),
        kinds=dict(Counter(kind_of(u) for u in units)),
        prunable=len(prunable),
        prunable_kinds=dict(Counter(kind_of(u) for u in units if u.name in set(prunable))),
        selected=len(selected),
        left_out=left_out,
        reasons=group_reasons(left_out, module_names),
    )
    tally.take()
    if not selected or not args.engines:
        return finish(writer, started)

    # random labels: the model's own predictions can give a cross-entropy of exactly 0 (saturated random logits)
    labels = torch.randint(0, NUM_CLASSES, (args.images,), generator=generator)
    data = [(images[i : i + args.batch], labels[i : i + args.batch]) for i in range(0, args.images, args.batch)]
    chosen = None if len(selected) == len(prunable) else selected
    extra = {"units": list(kinds)} if "units" in inspect.signature(analysis.analysis_prune).parameters else {}
    engines: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="coverage-") as folder:
        files = {engine: Path(folder) / f"{engine}.pkl" for engine in args.engines}
        for engine, path in files.items():
            with phase(writer, f"engine_{engine}") as ran:
                analysis.analysis_prune(model, data, path, pruned_ratios=[args.ratio], metric=args.metric,
                                        prune_params=chosen, engine=engine, progress=False, **extra)  # fmt: skip
            result: dict[str, Any] = {"seconds": ran["seconds"], "ok": ran["ok"]}
            if path.exists():
                with phase(writer, f"read_{engine}"):
                    result.update(engine_result(path, selected, args.ratio, ran["ok"]))
            result["notes"] = notable(tally.take())
            engines[engine] = result
            writer.update(engines=engines)
        if all(files[e].exists() and engines[e]["ok"] for e in ENGINES if e in files) and len(files) == 2:
            with phase(writer, "compare"):
                writer.update(fast_vs_reference=compare_engines(files["reference"], files["fast"]))
    return finish(writer, started)


def kind_of(unit: Any) -> str:
    """A unit's kind (``conv``, ``linear``, ``heads``); ``conv`` for versions whose units are all convs."""
    return str(getattr(unit, "kind", "conv"))


def unit_kinds(wanted: Sequence[str] | None) -> tuple[str, ...]:
    """The unit kinds to analyse: ``wanted``, or every kind this version of the package knows."""
    import analysis.config

    known = tuple(getattr(analysis.config, "UNIT_KINDS", ("conv",)))
    return tuple(k for k in known if k in wanted) if wanted else known


def notable(messages: Sequence[str]) -> dict[str, Any]:
    """Counts and examples of the engine messages that change how units were evaluated."""
    keys = {
        "untraceable": "torch.fx cannot trace",
        "split_fallback": "graph split differs",
        "not_analysed": "is not analysed",
        "physical": "evaluating it on physically pruned copies",
    }
    notes: dict[str, Any] = {}
    for key, text in keys.items():
        hits = [m for m in messages if text in m]
        if hits:
            notes[key] = {"count": len(hits), "first": hits[0][:300]}
    return notes


def finish(writer: RecordWriter, started: float) -> int:
    """Close the record: its status, total time and peak memory."""
    import resource

    record = writer.record
    status = "error" if record.get("errors") else "ok"
    writer.update(phase="done", status=status, total_seconds=round(time.perf_counter() - started, 3),
                  peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))  # fmt: skip
    return 0


# ---------------------------------------------------------------------------------------------------- the parent


@dataclass
class Running:
    """A child process in flight."""

    spec: ModelSpec
    process: subprocess.Popen[bytes]
    record: Path
    stderr: Path
    started: float
    stderr_handle: Any = field(repr=False, default=None)


def start_child(spec: ModelSpec, args: argparse.Namespace, workdir: Path) -> Running:
    """Start the child that analyses ``spec`` (its own session, so that it can be stopped with its children)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", spec.key)
    record, stderr = workdir / f"{stem}.json", workdir / f"{stem}.stderr"
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", spec.key, "--record", str(record),
        "--threads", str(args.threads), "--images", str(args.images), "--batch", str(args.batch),
        "--ratio", str(args.ratio), "--metric", args.metric, "--max-units", str(args.max_units),
        "--seed", str(args.seed), "--engines", ",".join(args.engines) or "none", "--memory-gb", str(args.memory_gb),
    ]  # fmt: skip
    if args.units:
        command += ["--units", *args.units]
    if args.sizes:
        command += ["--sizes", *map(str, args.sizes)]
    handle = stderr.open("wb")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=handle, env=env, start_new_session=True)
    return Running(spec, process, record, stderr, time.perf_counter(), handle)


def stop(running: Running) -> None:
    """Dump the child's Python stacks (SIGUSR1, see :func:`main`), then kill its process group."""
    pid = running.process.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            running.process.wait(timeout=2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # the child's own session: only processes it started
    running.process.wait()


def collect(running: Running, timed_out: bool) -> dict[str, Any]:
    """The model's final record: the child's own, with the status the parent saw (timeout, crash)."""
    running.stderr_handle.close()
    record: dict[str, Any] = {"model": running.spec.key, "source": running.spec.source, "name": running.spec.name,
                              "family": running.spec.family}  # fmt: skip
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        record.update(json.loads(running.record.read_text()))
    lines = [line for line in running.stderr.read_text(errors="replace").splitlines() if line.strip()]
    code = running.process.returncode
    if timed_out:
        record["status"] = "timeout"
        record["stack"] = stack_tail(lines)
    elif record.get("phase") != "done":
        record["status"] = "crash"
        record["exit"] = code
        if code < 0:
            with contextlib.suppress(ValueError):
                record["exit"] = signal.Signals(-code).name
        record["stderr_tail"] = lines[-30:]
    record["wall_seconds"] = round(time.perf_counter() - running.started, 1)
    record["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return record


def stack_tail(lines: Sequence[str]) -> list[str]:
    """The last dumped Python stack of the main thread (innermost frame first), or the end of stderr."""
    starts = [i for i, line in enumerate(lines) if "most recent call first" in line]
    current = [i for i in starts if lines[i].startswith("Current thread")]  # the main thread handles the signal
    starts = current or starts
    if not starts:
        return list(lines[-30:])
    block = []
    for line in lines[starts[-1] + 1 :]:
        if not line.startswith("  File"):
            break
        block.append(line.strip())
    return block[:25]


def sweep(specs: Sequence[ModelSpec], args: argparse.Namespace, out: Path) -> None:
    """Run every spec in a child (``--jobs`` at a time) and append each record to ``out`` as it finishes."""
    pending, running = list(specs), []
    with tempfile.TemporaryDirectory(prefix="coverage-") as folder, stopped_on_exit(running):
        while pending or running:
            while pending and len(running) < args.jobs:
                spec = pending.pop(0)
                print(f"[{len(specs) - len(pending)}/{len(specs)}] {spec.key} ...", flush=True)
                running.append(start_child(spec, args, Path(folder)))
            time.sleep(0.2)
            for item in list(running):
                timed_out = item.process.poll() is None and time.perf_counter() - item.started > args.timeout
                if timed_out:
                    stop(item)
                if item.process.poll() is None:
                    continue
                running.remove(item)
                record = collect(item, timed_out)
                with out.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record, default=str) + "\n")
                print(f"    {row(record)[-1]}", flush=True)


@contextlib.contextmanager
def stopped_on_exit(running: list[Running]) -> Iterator[None]:
    """Kill the children still running when the sweep ends early (Ctrl-C, an error): they run in their own sessions."""
    try:
        yield
    finally:
        for item in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(item.process.pid, signal.SIGKILL)
            item.process.wait()


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """The last record of each model in a JSON-lines file (a truncated last line is ignored)."""
    records: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            records[record["model"]] = record
    return records


# ---------------------------------------------------------------------------------------------------- the table


def problems(record: dict[str, Any]) -> list[str]:
    """What breaks coverage for a model (failure, hang, unit dropped without a reason, engines disagreeing), one
    short phrase each; empty when every unit was analysed or left out with a reason."""
    found: list[str] = []
    status = record.get("status")
    if status == "timeout":
        found.append(f"timeout in {record.get('phase', '?')}")
    elif status == "crash":
        tail = record.get("stderr_tail") or [""]
        found.append(f"exit {record.get('exit')} in {record.get('phase', 'start')}: {tail[-1][:120]}")
    for where, error in (record.get("errors") or {}).items():
        found.append(f"{where}: {error['type']}: {error['message'][:120]}")
    for engine, result in (record.get("engines") or {}).items():
        if result.get("dropped"):
            found.append(f"{engine}: {len(result['dropped'])} unit(s) dropped without a reason")
    comparison = record.get("fast_vs_reference")
    if comparison and not comparison["equal"]:
        found.append(f"fast != reference (max diff {comparison['max_diff']:.3g}, {comparison['only_one']} only in one)")
    return found


def notes(record: dict[str, Any]) -> list[str]:
    """What is worth knowing but within the rules: units the engine left out with a reason, fast-engine fallbacks."""
    engines = record.get("engines") or {}
    result = engines.get("reference") or engines.get("fast") or {}
    found: list[str] = []
    failed = result.get("failed_physical", 0)
    if failed:
        found.append(f"physical pruning failed for {failed}")
    other = len(result.get("skipped") or {}) - failed
    if other:
        found.append(f"{other} skipped while running")
    fast = (engines.get("fast") or {}).get("notes") or {}
    if "untraceable" in fast:
        found.append("fast engine ran as reference (torch.fx)")
    if "split_fallback" in fast:
        found.append(f"{fast['split_fallback']['count']} unit(s) on the reference path in the fast engine")
    return found


def kinds_text(kinds: dict[str, int] | None, total: Any) -> str:
    """``52`` or ``60 (conv 52, linear 8)`` when units of several kinds were found."""
    if total is None:
        return "-"
    if not kinds or list(kinds) == ["conv"]:
        return str(total)
    return f"{total} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})"


def row(record: dict[str, Any]) -> tuple[str, ...]:
    """One table row: model, source, size, found, prunable, analysed, mask/physical/failed, fast==ref, times, status."""
    engines = record.get("engines") or {}
    first = engines.get("reference") or engines.get("fast") or {}
    modes = first.get("modes") or {}
    selected = record.get("selected")
    read = "analysed" in first
    analysed = f"{first['analysed']}" if read else "-"
    if read and selected is not None and selected != record.get("prunable"):
        analysed += f" of {selected}"
    failed = first.get("failed_physical", 0)
    modes_text = "-" if not read else f"{modes.get('mask', 0)}/{modes.get('physical', 0)}/{failed}"
    comparison = record.get("fast_vs_reference")
    same = "-" if not comparison else f"{'yes' if comparison['equal'] else 'NO'} {comparison['max_diff']:.1g}"
    issues, remarks = problems(record), notes(record)
    status = record.get("status", "?")
    if status == "ok" and issues:
        status = "problem"
    text = status if not issues else f"{status}: {'; '.join(issues)}"
    text += f" ({'; '.join(remarks)})" if remarks else ""
    return (
        record.get("name", record["model"]),
        record.get("source", "?"),
        str(record.get("size", "-")),
        kinds_text(record.get("kinds"), record.get("found")),
        str(record.get("prunable", "-")),
        analysed,
        modes_text,
        same,
        seconds(record.get("discovery_seconds")),
        seconds(record.get("total_seconds") or record.get("wall_seconds")),
        text,
    )


def seconds(value: Any) -> str:
    """``12.3`` or ``-``."""
    return "-" if value is None else f"{float(value):.1f}"


HEADER = ("model", "source", "size", "units found", "prunable", "analysed", "mask/phys/fail", "fast==ref",
          "discovery s", "total s", "status")  # fmt: skip


def print_table(records: Sequence[dict[str, Any]], reasons: bool = True) -> None:
    """The coverage table (Markdown), then per model the reasons of the units left out, with counts."""
    rows = [HEADER, *(row(r) for r in records)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)] + [0]  # the status is not padded
    for index, cells in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
        if index == 0:
            print("| " + " | ".join("-" * max(3, w) for w in widths) + " |")
    counts = Counter(re.split(r"[:( ]", r[-1], maxsplit=1)[0] for r in rows[1:])
    print(f"\n{len(records)} model(s): " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if not reasons:
        return
    print("\nUnits left out, by reason:")
    for record in records:
        grouped = dict(record.get("reasons") or {})
        engines = record.get("engines") or {}
        skipped = {(n, r) for result in engines.values() for n, r in (result.get("skipped") or {}).items()}
        for _, reason in sorted(skipped):  # a unit both engines skipped for one reason counts once
            grouped[f"[engine] {reason}"] = grouped.get(f"[engine] {reason}", 0) + 1
        for name in sorted({n for result in engines.values() for n in result.get("dropped") or []}):
            grouped[f"[DROPPED, no reason] {name}"] = 1
        collapsed: Counter[str] = Counter()  # numbers collapsed, so that one failure at many channel counts is one line
        for reason, count in grouped.items():
            collapsed[re.sub(r"\d+", "N", reason) if not reason.startswith("[DROPPED") else reason] += count
        if collapsed:
            print(f"  {record['model']}:")
            for reason, count in collapsed.most_common():
                print(f"    {count:4d}  {reason}")
        stack = record.get("stack")
        if stack:
            print(f"  {record['model']}: stack at timeout (innermost first):")
            for line in stack[:8]:
                print(f"      {line}")


def summary_rows(records: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The coverage summary of docs/benchmarks.md, torchvision and timm side by side: one ``(what, torchvision,
    timm)`` per row."""
    columns = []
    for source in ("torchvision", "timm"):
        mine = [r for r in records if r.get("source") == source]
        clean = [r for r in mine if r.get("status") == "ok" and not problems(r)]
        counted = [r for r in mine if r.get("found") is not None]
        kinds: Counter[str] = Counter()
        for record in counted:
            kinds.update(record.get("kinds") or {})
        found = sum(r["found"] for r in counted)
        per_model = sorted(counted, key=lambda r: r["found"])
        largest = per_model[-1] if per_model else None
        median = per_model[len(per_model) // 2]["found"] if per_model else 0
        firsts = [(r.get("engines") or {}).get("reference") or {} for r in counted]
        analysed = sum(e.get("analysed", 0) for e in firsts)
        selected = sum(r.get("selected") or 0 for r in counted)
        failed = sum(len(e.get("skipped") or {}) for e in firsts)
        dropped = sum(len(e.get("dropped") or []) for e in firsts)
        compared = [r for r in counted if r.get("fast_vs_reference")]
        same = sum(1 for r in compared if r["fast_vs_reference"]["equal"])
        columns.append((
            str(len(mine)),
            str(len(clean)),
            f"{found} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})",
            str(sum(r.get("prunable") or 0 for r in counted)),
            f"{median} ({largest['name']}: {largest['found']})" if largest else "-",
            f"{analysed} / {selected}",
            str(failed),
            str(dropped),
            f"{same} of {len(compared)}",
        ))  # fmt: skip
    labels = (
        "models", "analysed without error", "units found (models analysed)", "of which prunable",
        "units per model, median (max)", "sampled units analysed / selected",
        "sampled units left out by the engine (with a reason)", "selected but neither analysed nor given a reason",
        "fast engine == reference engine",
    )  # fmt: skip
    return [(label, tv, tm) for label, tv, tm in zip(labels, *columns, strict=True)]


def print_summary(records: Sequence[dict[str, Any]]) -> None:
    """The summary of :func:`summary_rows` as a Markdown table."""
    print("| | torchvision | timm |\n| --- | --- | --- |")
    for label, torchvision, timm in summary_rows(records):
        print(f"| {label} | {torchvision} | {timm} |")


# ------------------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (the ``--child``/``--record`` pair is internal)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", help="names or globs (e.g. 'resnet*', 'timm:vit_*'); default all")
    parser.add_argument("--source", choices=("torchvision", "timm", "all"), default="all")
    parser.add_argument("--timeout", type=float, default=600.0, help="wall-clock seconds per model (default 600)")
    parser.add_argument("--resume", action="store_true", help="skip models already recorded in --out")
    parser.add_argument("--retry-failed", action="store_true", help="with --resume: rerun timeouts, crashes, errors")
    parser.add_argument("--jobs", type=int, default=1, help="models analysed at once (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per model (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON-lines records (default %(default)s)")
    parser.add_argument("--engines", default="reference,fast",
                        help="comma-separated engines to run, or 'none' for discovery only")  # fmt: skip
    parser.add_argument("--images", type=int, default=8, help="random images analysed (default 8)")
    parser.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    parser.add_argument("--ratio", type=float, default=0.5, help="the one pruning ratio (default 0.5)")
    parser.add_argument("--metric", default="ce", help="analysis metric (default ce)")
    parser.add_argument("--units", nargs="+", help="unit kinds to analyse (conv, linear, heads); default all")
    parser.add_argument("--max-units", type=int, default=0, help="analyse at most this many units, spread evenly")
    parser.add_argument("--sizes", type=int, nargs="+", help=f"input sizes to try, smallest first (default {SIZES})")
    parser.add_argument("--memory-gb", type=float, default=16.0,
                        help="address-space limit per model in GiB, 0 for none (default 16)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-only", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--no-reasons", action="store_true", help="print the table without the reasons")
    parser.add_argument("--summary", action="store_true", help="also print the summary table of docs/benchmarks.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.engines = [] if args.engines == "none" else [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"--engines: unknown engine(s) {', '.join(sorted(unknown))}; use reference, fast or none")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep (or, with ``--child``, one model) and print the table."""
    args = parse_args(argv)
    if args.child:
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for the stacks before a kill
        return child(args)
    out: Path = args.out
    if args.print_only:
        records = list(read_records(out).values())
        print_table(records, not args.no_reasons)
        if args.summary:
            print()
            print_summary(records)
        return 0
    if args.source in ("timm", "all"):
        missing = check_timm_names()
        if missing:
            print(f"timm {importlib.metadata.version('timm')} lacks: {', '.join(missing)}", file=sys.stderr)
    specs = select_specs(all_specs(args.source), args.models)
    if not specs:
        print("No model matches --models.", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_records(out) if args.resume else {}
    if not args.resume and out.exists():
        out.unlink()
    failed = ("timeout", "crash", "error")
    todo = [s for s in specs if s.key not in done or (args.retry_failed and done[s.key].get("status") in failed)]
    if done:
        print(f"Resuming: {len(specs) - len(todo)} of {len(specs)} model(s) already in {out}.")
    sweep(todo, args, out)
    records = read_records(out)
    print()
    print_table([records[s.key] for s in specs if s.key in records], not args.no_reasons)
    if args.summary:
        print()
        print_summary([records[s.key] for s in specs if s.key in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Sensitivity-analysis speed: the reference engine, the fast engine and (optionally) NNI 2.10, side by side.

For each model (random weights, img_size 224) on the same deterministic synthetic ImageNet-style JPEG folder and
the same ratios, each engine runs in its own child process (so peak RSS is its own), and the table shows:

* wall time of the reference engine (one full pass per variant, decoding every pass, as PaddleSlim/NNI do), of the
  fast engine (decode once, graph suffixes only) and of NNI's ``SensitivityAnalysis`` when ``--nni-python`` names
  a Python that has NNI 2.10 (see ``benchmarks/nni_peer.py``);
* speed-ups, peak RSS of each, and that both engines wrote byte-identical analysis files;
* the ideal bound: one decode pass + one full forward pass + the sum over variants of the forward time of the part
  of the network each variant changes (node times measured on a real batch), and efficiency = ideal / fast.

With ``--small`` it measures instead where per-unit fixed costs weigh most: 32 random images at 128 px (random
weights and BatchNorm statistics, 10 classes, data in memory as a list of batches) through ``analysis_prune``,
ratios 0.2 and 0.4, every prunable conv of resnet18, mobilenet_v2 and efficientnet_b0; each engine again in its own
process, timed by that process's CPU time (``time.process_time``, robust on a shared machine) with ``--threads``
torch threads, next to its wall time; the speed-up is reference CPU time / fast CPU time.

    python benchmarks/bench_engine.py                              # all four models, 256 images (long on a CPU)
    python benchmarks/bench_engine.py --models resnet18 --images 64 --max-params 8   # a quick look
    python benchmarks/bench_engine.py --small                      # small data: about 2 minutes on one core
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("analysis") is None:  # not installed: use the source tree this script lives in
    sys.path.insert(0, str(REPO_ROOT))

MODELS = ("resnet18", "mobilenet_v2", "resnet50", "efficientnet_b0")
SMALL_MODELS = ("resnet18", "mobilenet_v2", "efficientnet_b0")
SMALL_IMAGES, SMALL_SIZE, SMALL_RATIOS, SMALL_CLASSES = 32, 128, (0.2, 0.4), 10
"""The small-data row: few images, so the fixed work per unit (mask check, split check, copies) dominates."""
DEFAULT_DATA = REPO_ROOT / "benchmarks" / "_data"


def load_bench_data() -> Any:
    """The synthetic-JPEG generator and machine description shared with ``bench_data.py``."""
    spec = importlib.util.spec_from_file_location("bench_data", Path(__file__).with_name("bench_data.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_data"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM), in MB."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --------------------------------------------------------------------------------------------------- child runs


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Run one engine on one model in this process and return its measurements."""
    from analysis.config import GlobalConfig, SensitivityConfig
    from analysis.engine.evaluate import evaluate
    from analysis.engine.settings import AnalysisData, EngineSettings
    from analysis.inputs.data import apply_data_cache, build_eval_loader
    from analysis.inputs.models import build_model
    from analysis.structure.groups import find_prunable
    from analysis.workflow.analyse import Selection, run_analysis

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    cfg = GlobalConfig(
        arch=args.model, data_dir=str(args.root), img_size=224, resize_size=256, batch_size=args.batch_size,
        num_workers=args.workers, device="cpu", data_cache="ram" if args.engine == "fast" else "off",
    )  # fmt: skip
    device = torch.device("cpu")
    loader = build_eval_loader(cfg, device)
    model = build_model(cfg)
    decode_start = time.perf_counter()
    apply_data_cache(loader, cfg.data_cache, None, progress=False)
    decode_seconds = time.perf_counter() - decode_start
    example = next(iter(loader))[0][:32]
    params = [p.name for p in find_prunable(model, example) if p.prunable]
    chosen = evenly_spaced(params, args.max_params)
    section = SensitivityConfig(pruned_ratios=args.ratios, metric="ce", engine=args.engine)
    settings = EngineSettings.from_section(section, progress=False)
    data = AnalysisData(evaluate=lambda m: evaluate(m, loader, progress=False).metrics(), example_input=example,
                        batches=loader)  # fmt: skip
    run_analysis(model, data, args.analysis_file, settings, selection=Selection(prune_params=chosen), overwrite=True)
    result = {
        "engine": args.engine, "model": args.model, "seconds": time.perf_counter() - start,
        "peak_rss_mb": peak_rss_mb(), "params": len(chosen), "variants": len(chosen) * len(args.ratios),
        "convs": chosen,
    }  # fmt: skip
    if args.engine == "fast":
        result["ideal"] = ideal_bound(model, loader, chosen, len(args.ratios), decode_seconds)
    return result


def small_child(args: argparse.Namespace) -> dict[str, Any]:
    """Run one engine on in-memory random data (``--small``) in this process and return its CPU and wall time."""
    from analysis.compat.paddleslim import analysis_prune
    from analysis.structure.groups import find_prunable

    torch.set_num_threads(args.threads)
    model, batches = small_inputs(args.model, args.images, args.batch_size, args.seed)
    chosen = None
    if args.max_params is not None:
        chosen = evenly_spaced([p.name for p in find_prunable(model, batches[0][0]) if p.prunable], args.max_params)
    cpu, wall = time.process_time(), time.perf_counter()
    analysis_prune(model, batches, args.analysis_file, pruned_ratios=args.ratios, prune_params=chosen,
                   engine=args.engine, overwrite=True, progress=False)  # fmt: skip
    return {
        "engine": args.engine, "model": args.model, "cpu_seconds": time.process_time() - cpu,
        "seconds": time.perf_counter() - wall, "threads": torch.get_num_threads(),
    }  # fmt: skip


def small_inputs(arch: str, images: int, batch_size: int, seed: int) -> tuple[torch.nn.Module, list[Any]]:
    """A torchvision model with random weights and random BatchNorm statistics (so BN is far from an identity, as
    in a trained network) and random images and labels as a list of ``(images, labels)`` batches, all seeded."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.get_model(arch, weights=None, num_classes=SMALL_CLASSES).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
                module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
    batches = []
    for start in range(0, images, batch_size):
        count = min(batch_size, images - start)
        batches.append((torch.randn(count, 3, SMALL_SIZE, SMALL_SIZE, generator=generator),
                        torch.randint(0, SMALL_CLASSES, (count,), generator=generator)))  # fmt: skip
    return model, batches


def evenly_spaced(names: list[str], limit: int | None) -> list[str]:
    """All names, or ``limit`` of them spread evenly over the model (first and last included)."""
    if limit is None or limit >= len(names):
        return names
    if limit == 1:
        return names[:1]
    step = (len(names) - 1) / (limit - 1)
    return [names[round(i * step)] for i in range(limit)]


def ideal_bound(model: torch.nn.Module, loader: Any, names: list[str], ratios: int, decode: float) -> dict[str, float]:
    """One decode pass + one full forward + the timed forward of every variant's changed part (no overheads).

    Each param's changed part (its graph suffix) is run once per batch, unmasked (the same work as a masked run),
    and timed on its own; the frontier it starts from is computed outside the timing.
    """
    from analysis.engine.evaluate import evaluate
    from analysis.engine.partition import GraphRunner
    from analysis.structure.groups import build_dependency_graph, full_group

    forward = evaluate(model, loader, progress=False).seconds
    runner = GraphRunner(model)
    graph = build_dependency_graph(model, next(iter(loader))[0])
    downstream = 0.0
    for name in names:
        conv = model.get_submodule(name.rsplit(".", 1)[0])
        members = [item.dep.target.module for item in full_group(graph, conv)]
        plan = runner.plan([m for m in members if isinstance(m, torch.nn.Module)],
                           [m for m in members if isinstance(m, torch.nn.Parameter)])  # fmt: skip
        if plan is None:
            downstream += ratios * forward
            continue
        schedule = runner.schedule([plan])
        spent = [0.0]

        def timed(plan: Any, frontier: dict, spent: list[float] = spent) -> None:
            start = time.perf_counter()
            runner.run_suffix(plan, frontier)
            spent[0] += time.perf_counter() - start

        with torch.inference_mode():
            for images, _ in loader:
                runner.walk(images, schedule, timed)
        downstream += ratios * spent[0]
    return {"decode": decode, "forward": forward, "downstream": downstream, "total": decode + forward + downstream}


# -------------------------------------------------------------------------------------------------- orchestration


def run_child(args: argparse.Namespace, model: str, engine: str, workdir: Path) -> dict[str, Any]:
    """Run :func:`child` in a fresh interpreter and return its JSON result."""
    out = workdir / f"{model}-{engine}.json"
    command = [
        sys.executable, __file__, "--child", "--model", model, "--engine", engine,
        "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--seed", str(args.seed),
        "--analysis-file", str(workdir / f"{model}-{engine}.pkl"), "--out", str(out),
        "--ratios", *map(str, args.ratios),
    ]  # fmt: skip
    if args.small:
        command += ["--small", "--images", str(args.images), "--threads", str(args.threads)]
    else:
        command += ["--root", str(args.root)]
    if args.max_params is not None:
        command += ["--max-params", str(args.max_params)]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def run_nni(args: argparse.Namespace, model: str, workdir: Path, convs: list[str]) -> dict[str, Any] | None:
    """NNI 2.10's SensitivityAnalysis on the same data, ratios and convs, in the Python given by ``--nni-python``."""
    if not args.nni_python:
        return None
    out = workdir / f"{model}-nni.json"
    command = [
        args.nni_python, str(Path(__file__).with_name("nni_peer.py")), "--data", str(args.root), "--arch", model,
        "--img-size", "224", "--resize-size", "256", "--batch-size", str(args.batch_size), "--workers",
        str(args.workers), "--seed", str(args.seed), "--out", str(out), "--ratios", *map(str, args.ratios),
        "--layer-names", *[name.rsplit(".", 1)[0] for name in convs],
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def row(model: str, ref: dict, fast: dict, nni: dict | None, identical: bool) -> str:
    """One line of the results table."""
    ideal = fast["ideal"]["total"]
    nni_text = f"{nni['seconds']:8.1f} {nni['seconds'] / fast['seconds']:6.2f}x" if nni else f"{'n/a':>8} {'':>7}"
    return (
        f"{model:<16} {fast['params']:>3}x{fast['variants'] // max(1, fast['params'])} "
        f"{ref['seconds']:9.1f} {fast['seconds']:8.1f} {ref['seconds'] / fast['seconds']:7.2f}x {nni_text} "
        f"{ref['peak_rss_mb']:8.0f} {fast['peak_rss_mb']:8.0f} {ideal:8.1f} {ideal / fast['seconds']:6.2f} "
        f"{'yes' if identical else 'NO'}"
    )


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; run either one child measurement or the whole side-by-side benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, help="default: all four (--small: all but resnet50)")
    parser.add_argument("--images", type=int, help=f"synthetic JPEGs of about 500x375 (default 256; --small: random "
                        f"{SMALL_SIZE} px images, default {SMALL_IMAGES})")  # fmt: skip
    parser.add_argument("--ratios", type=float, nargs="+", help="default 0.1 0.2 0.3 0.4 (--small: 0.2 0.4)")
    parser.add_argument("--small", action="store_true", help="the small-data row (see above) instead of the table")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine with --small")
    parser.add_argument("--repeats", type=int, default=1, help="with --small: runs per engine, the fastest kept")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="decoding processes")
    parser.add_argument("--max-params", type=int, help="analyse only this many convs, evenly spread (default all)")
    parser.add_argument("--nni-python", help="a Python with NNI 2.10 installed, to run NNI as the external peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, help="data folder (default: benchmarks/_data/synthetic_<images>)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--analysis-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = args.models or list(SMALL_MODELS if args.small else MODELS)
    args.images = args.images or (SMALL_IMAGES if args.small else 256)
    args.ratios = args.ratios or list(SMALL_RATIOS if args.small else (0.1, 0.2, 0.3, 0.4))
    if args.child:
        Path(args.out).write_text(json.dumps(small_child(args) if args.small else child(args)))
        return 0
    if args.small:
        return main_small(args)
    bench_data = load_bench_data()
    args.root = args.root or DEFAULT_DATA / f"synthetic_{args.images}"
    print(f"data: {args.root} ({bench_data.ensure_dataset(args.root, args.images, 8, args.seed)})")
    print(bench_data.machine_description())
    print(f"ratios {args.ratios}; batch {args.batch_size}; {args.workers} decoding workers; metric ce; "
          f"{'all' if args.max_params is None else args.max_params} prunable convs per model")  # fmt: skip
    header = (
        f"{'model':<16} {'convs':>5} {'reference':>9} {'fast':>8} {'speedup':>8} {'nni':>8} {'vs nni':>7} "
        f"{'rss ref':>8} {'rss fast':>8} {'ideal':>8} {'effic.':>6} same"
    )
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for model in args.models:
            ref = run_child(args, model, "reference", workdir)
            fast = run_child(args, model, "fast", workdir)
            nni = run_nni(args, model, workdir, fast["convs"])
            same = (workdir / f"{model}-fast.pkl").read_bytes() == (workdir / f"{model}-reference.pkl").read_bytes()
            lines.append(row(model, ref, fast, nni, same))
            print(header + "\n" + lines[-1], flush=True)
            ideal = fast["ideal"]
            print(f"{model}: reference {ref['seconds']:.1f} s, fast {fast['seconds']:.1f} s; ideal "
                  f"{ideal['total']:.1f} s = decode {ideal['decode']:.1f} + forward {ideal['forward']:.1f} + "
                  f"downstream {ideal['downstream']:.1f}", flush=True)  # fmt: skip
    print("\n" + header)
    print("\n".join(lines))
    print("(seconds of wall time per child process incl. imports; rss in MB; ideal = decode pass + one forward + "
          "timed downstream forwards; effic. = ideal / fast; same = byte-identical analysis files)")  # fmt: skip
    return 0 if all(line.endswith("yes") for line in lines) else 1


def main_small(args: argparse.Namespace) -> int:
    """The small-data row: both engines per model on in-memory random data, CPU time side by side."""
    torch.set_num_threads(args.threads)  # as in the children, so the machine line shows their thread count
    print(load_bench_data().machine_description())
    print(f"small data: {args.images} random images at {SMALL_SIZE} px, batch {args.batch_size}, ratios "
          f"{args.ratios}, {args.threads} torch thread(s) per engine, random weights and BatchNorm statistics, "
          f"{args.max_params or 'all'} prunable convs; best of {args.repeats}")  # fmt: skip
    header = f"{'model':<16} {'ref cpu':>8} {'fast cpu':>8} {'speedup':>8} {'ref wall':>8} {'fast wall':>9} same"
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for model in args.models:
            ref, fast = (
                min((run_child(args, model, engine, workdir) for _ in range(args.repeats)),
                    key=lambda result: result["cpu_seconds"])
                for engine in ("reference", "fast")
            )  # fmt: skip
            same = (workdir / f"{model}-fast.pkl").read_bytes() == (workdir / f"{model}-reference.pkl").read_bytes()
            lines.append(
                f"{model:<16} {ref['cpu_seconds']:8.2f} {fast['cpu_seconds']:8.2f} "
                f"{ref['cpu_seconds'] / fast['cpu_seconds']:7.2f}x {ref['seconds']:8.2f} {fast['seconds']:9.2f} "
                f"{'yes' if same else 'NO'}"
            )
            print(header + "\n" + lines[-1], flush=True)
    print("\n" + header)
    print("\n".join(lines))
    print("(seconds of CPU time and of wall time of analysis_prune in each engine's process, imports and model "
          "building excluded; speedup = ref cpu / fast cpu; same = byte-identical analysis files)")  # fmt: skip
    return 0 if all(line.endswith("yes") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The decoded images on a GPU (issue 30): kept in GPU memory or in pinned host memory, they give batches bit-identical
to the host path's (the same uint8 bytes copied to the GPU and normalised there), for the evaluation images, in
order, in a given order, for a subset, and for the calibration images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from analysis.config import GlobalConfig
from analysis.inputs.calibration import build_calibration_set
from analysis.inputs.data import EvalLoader, Preprocess, build_eval_loader, normalize_batch

from helpers import write_images, write_train_list

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = torch.device("cuda")
BATCH = 8
PLACEMENTS = [(1.0, "device"), (0.0, "pinned")]  # a tiny cache takes far less than the free GPU memory
Batches = list[tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """20 evaluation images (labels 0..9 twice, PaddleSlim layout) and 12 training images beside them."""
    root = tmp_path / "data"
    write_images(root, "list", [i % 10 for i in range(20)])
    write_train_list(root, 12)
    return root


def config(root: Path, share: float = 0.5) -> GlobalConfig:
    return GlobalConfig(
        data_dir=str(root), batch_size=BATCH, img_size=16, resize_size=16, num_workers=0, device="cuda",
        device_cache_share=share,
    )  # fmt: skip


def decoded(root: Path, device: torch.device) -> EvalLoader:
    """The evaluation images of ``root`` decoded into RAM for batches on ``device`` (not placed yet)."""
    loader = build_eval_loader(config(root), device)
    loader.cache_in_memory(progress=False)
    return loader


def host_batches(cached: tuple[torch.Tensor, torch.Tensor], preprocess: Preprocess, positions: list[int]) -> Batches:
    """The host path, by hand: the uint8 rows at ``positions`` of a cache in RAM, copied to the GPU and normalised
    there, in batches of :data:`BATCH`."""
    images, labels = cached
    assert images.device.type == "cpu"
    index = torch.tensor(positions)
    return [
        (normalize_batch(images[part].to(GPU), preprocess), labels[part].to(GPU))
        for part in (index[start : start + BATCH] for start in range(0, len(positions), BATCH))
    ]


def assert_same(got: Batches, expected: Batches) -> None:
    assert len(got) == len(expected)
    for (images, labels), (want_images, want_labels) in zip(got, expected, strict=True):
        assert images.is_cuda and labels.is_cuda
        assert images.dtype == torch.float32 and torch.equal(images, want_images)
        assert torch.equal(labels, want_labels)


def assert_placed(loader: EvalLoader, placement: str) -> None:
    assert loader.cache_placement == placement and loader.cached is not None
    images, labels = loader.cached
    if placement == "device":
        assert images.is_cuda and labels.is_cuda
    else:
        assert images.device.type == "cpu" and images.is_pinned() and labels.is_pinned()


@pytest.mark.parametrize(("share", "placement"), PLACEMENTS)
def test_placed_batches_equal_the_host_path(data: Path, share: float, placement: str) -> None:
    host = decoded(data, GPU)
    assert host.cached is not None and host.cache_placement == "host"
    loader = decoded(data, GPU)
    assert loader.place_cache(share) == placement
    assert_placed(loader, placement)
    everything = list(range(20))
    assert_same(list(loader), host_batches(host.cached, host.preprocess, everything))
    assert_same(list(host), host_batches(host.cached, host.preprocess, everything))  # an unplaced cache too

    order = torch.randperm(20, generator=torch.Generator().manual_seed(3)).tolist()
    in_order = list(loader.in_order(order))
    assert_same([(images, labels) for images, labels, _ in in_order], host_batches(host.cached, host.preprocess, order))
    assert [index.tolist() for _, _, index in in_order] == [order[:8], order[8:16], order[16:]]

    subset = loader.subset(7, seed=2)
    assert_placed(subset, placement)
    positions = [loader.samples.index(sample) for sample in subset.samples]
    assert_same(list(subset), host_batches(host.cached, host.preprocess, positions))


@pytest.mark.parametrize(("share", "placement"), PLACEMENTS)
def test_batches_stay_right_while_the_gpu_is_busy(data: Path, share: float, placement: str) -> None:
    """Copies run one batch ahead on a side stream: a slow consumer must still get every batch's own bytes (the
    current stream waits for each copy, and a copied batch's memory is not reused before it is normalised)."""
    host = decoded(data, GPU)
    assert host.cached is not None
    loader = decoded(data, GPU)
    loader.place_cache(share)
    expected = host_batches(host.cached, host.preprocess, list(range(20)))
    for _ in range(3):
        got = []
        for images, labels in loader:
            torch.cuda._sleep(50_000_000)  # keep the current stream busy while the next copy is issued
            got.append((images.clone(), labels.clone()))
        assert_same(got, expected)


@pytest.mark.parametrize(("share", "placement"), PLACEMENTS)
def test_measured_staging_gives_the_same_batches(data: Path, share: float, placement: str) -> None:
    loader = decoded(data, GPU)
    loader.place_cache(share)
    first = list(loader)
    assert loader.staging_seconds > 0
    loader.measure_staging = True
    before = loader.staging_seconds
    assert_same(list(loader), first)
    assert loader.staging_seconds > before


@pytest.mark.parametrize(("share", "placement"), PLACEMENTS)
def test_calibration_batches_equal_the_host_path(data: Path, share: float, placement: str) -> None:
    cfg = config(data, share)
    on_cpu = build_calibration_set(cfg, torch.device("cpu"), build_eval_loader(cfg, torch.device("cpu")), False)
    calibration = build_calibration_set(cfg, GPU, build_eval_loader(cfg, GPU), progress=False)
    assert on_cpu is not None and calibration is not None and on_cpu.loader.cached is not None
    assert [s.path for s in calibration.loader.samples] == [s.path for s in on_cpu.loader.samples]
    assert_placed(calibration.loader, placement)
    expected = host_batches(on_cpu.loader.cached, on_cpu.loader.preprocess, list(range(12)))
    assert_same(list(calibration.loader), expected)
    search = calibration.loader.subset(5, seed=1)  # what a measured plan searches on
    assert_placed(search, placement)
    positions = [calibration.loader.samples.index(sample) for sample in search.samples]
    assert_same(list(search), host_batches(on_cpu.loader.cached, on_cpu.loader.preprocess, positions))

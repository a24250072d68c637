"""Evaluation data: both layouts, the exact eval transform, subsets, and clear errors for broken data."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from analysis.config import GlobalConfig
from analysis.errors import ConfigError, DataError
from analysis.inputs import calibration
from analysis.inputs import data as data_module
from analysis.inputs.data import (
    EvalLoader,
    Preprocess,
    build_eval_loader,
    find_samples,
    load_image,
    normalize_batch,
    select_subset,
)
from analysis.inputs.placement import cache_placement, describe_placement, pinned_copy_bytes, prefetched

from helpers import write_images

CPU = torch.device("cpu")


def test_paddleslim_list_layout_keeps_list_order_and_labels(tmp_path: Path) -> None:
    labels = [3, 1, 4, 1, 5, 9, 2, 6]
    write_images(tmp_path, "list", labels)
    samples, layout = find_samples(tmp_path)
    assert "PaddleSlim list" in layout
    assert [s.label for s in samples] == labels
    assert [Path(s.path).name for s in samples] == [f"img_{i:04d}.png" for i in range(len(labels))]
    assert samples[2].source.endswith("val_list.txt line 3")


def test_image_folder_layout_sorts_classes_like_torchvision(tmp_path: Path) -> None:
    root = tmp_path / "data"
    for name in ["n02", "n10", "n01"]:
        (root / "val" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(root / "val" / name / "b.JPEG")
        Image.new("RGB", (8, 8)).save(root / "val" / name / "a.png")
    (root / "val" / "n01" / "notes.txt").write_text("not an image")
    samples, layout = find_samples(root)
    assert "ImageFolder" in layout
    assert [(Path(s.path).parent.name, Path(s.path).name, s.label) for s in samples] == [
        ("n01", "a.png", 0), ("n01", "b.JPEG", 0), ("n02", "a.png", 1), ("n02", "b.JPEG", 1),
        ("n10", "a.png", 2), ("n10", "b.JPEG", 2),
    ]  # fmt: skip


def test_list_layout_wins_when_both_are_present(tmp_path: Path) -> None:
    write_images(tmp_path, "list", [0, 1])
    (tmp_path / "val" / "cls").mkdir()
    assert "PaddleSlim" in find_samples(tmp_path)[1]


def test_custom_val_list_name_and_blank_or_comment_lines(tmp_path: Path) -> None:
    write_images(tmp_path, "list", [0, 1, 2])
    text = (tmp_path / "val_list.txt").read_text()
    (tmp_path / "small.txt").write_text("# header\n\n" + text)
    samples, _ = find_samples(tmp_path, "small.txt")
    assert [s.label for s in samples] == [0, 1, 2]
    assert samples[0].source.endswith("small.txt line 3")


def test_transform_matches_hand_computed_pixels(tmp_path: Path) -> None:
    # 6 wide x 4 high: the short side is already resize_size, so only the crop and normalisation act.
    pixels = np.arange(6 * 4 * 3, dtype=np.uint8).reshape(4, 6, 3) * 2
    Image.fromarray(pixels).save(tmp_path / "x.png")
    pre = Preprocess(img_size=2, resize_size=4, mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0))
    image = load_image(str(tmp_path / "x.png"), pre)
    assert image.dtype == torch.uint8 and image.shape == (3, 2, 2)
    # torchvision's center crop: top = round((4 - 2) / 2) = 1, left = round((6 - 2) / 2) = 2.
    expected_uint8 = torch.from_numpy(pixels[1:3, 2:4].copy()).permute(2, 0, 1)
    assert torch.equal(image, expected_uint8)
    normalised = normalize_batch(image.unsqueeze(0), pre)[0]
    r, g, b = (expected_uint8[c].double() / 255 for c in range(3))
    expected = torch.stack([(r - 0.5) / 0.5, (g - 0.25) / 0.25, b])
    assert normalised.dtype == torch.float32
    assert torch.allclose(normalised.double(), expected, atol=1e-6)
    # e.g. the red value of the top-left output pixel is pixels[1, 2, 0] = (1*6 + 2) * 3 * 2 = 48.
    assert normalised[0, 0, 0].item() == pytest.approx((48 / 255 - 0.5) / 0.5, abs=1e-6)


@pytest.mark.parametrize(
    ("width", "height", "interpolation", "resample"),
    [(40, 30, "bilinear", Image.BILINEAR), (30, 47, "bicubic", Image.BICUBIC), (33, 50, "lanczos", Image.LANCZOS)],
)
def test_short_side_resize_then_center_crop(
    tmp_path: Path, width: int, height: int, interpolation: str, resample: int
) -> None:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "x.png")
    pre = Preprocess(img_size=16, resize_size=20, interpolation=interpolation)
    image = load_image(str(tmp_path / "x.png"), pre)
    # The short side becomes 20 and the long side int(20 * long / short) (torchvision's rule).
    short, long = min(width, height), max(width, height)
    new_long = int(20 * long / short)
    size = (20, new_long) if width < height else (new_long, 20)
    resized = np.asarray(Image.fromarray(pixels).resize(size, resample))
    top, left = round((resized.shape[0] - 16) / 2), round((resized.shape[1] - 16) / 2)
    expected = torch.from_numpy(resized[top : top + 16, left : left + 16].copy()).permute(2, 0, 1)
    assert torch.equal(image, expected)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_any_pillow_mode_becomes_rgb(tmp_path: Path, mode: str) -> None:
    path = tmp_path / ("x.jpg" if mode == "CMYK" else "x.png")
    Image.new("RGB", (8, 8), (10, 200, 30)).convert(mode).save(path)
    image = load_image(str(path), Preprocess(img_size=8, resize_size=8))
    assert image.shape == (3, 8, 8)
    if mode == "L":
        assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])
    pixels = image.permute(1, 2, 0).numpy().astype(int)  # HWC, as the expectations below
    if mode == "L":  # the luma 0.299 R + 0.587 G + 0.114 B = 123.81, stored rounded, in all three channels
        assert (pixels == 124).all()
    elif mode == "P":  # dithered to the web palette: each pixel is its stored index's palette colour
        with Image.open(path) as saved:
            palette = np.asarray(saved.getpalette(), dtype=int).reshape(-1, 3)
            expected = palette[np.asarray(saved)]
        assert len(np.unique(expected.reshape(-1, 3), axis=0)) > 1 and (pixels == expected).all()
    else:  # RGBA: alpha dropped; CMYK (C, M, Y) = 255 - (R, G, B) with K = 0, back through a near-lossless JPEG
        tolerance = 2 if mode == "CMYK" else 0
        assert (abs(pixels - np.array([10, 200, 30])) <= tolerance).all()


def test_subset_is_class_balanced_seeded_and_ordered(tmp_path: Path) -> None:
    labels = [0] * 30 + [1] * 30 + [2] * 4
    write_images(tmp_path, "list", labels, size=(4, 4))
    samples, _ = find_samples(tmp_path)
    subset = select_subset(samples, 18, seed=7)
    assert len(subset) == 18
    assert Counter(s.label for s in subset) == {0: 7, 1: 7, 2: 4}  # class 2 gives all it has, others share the rest
    order = [samples.index(s) for s in subset]
    assert order == sorted(order)
    assert select_subset(samples, 18, seed=7) == subset
    assert select_subset(samples, 18, seed=8) != subset
    assert select_subset(samples, 1000, seed=7) == samples


def test_loader_yields_normalised_batches_in_order(list_data: Path) -> None:
    cfg = GlobalConfig(data_dir=str(list_data), batch_size=8, img_size=16, resize_size=16, num_workers=0)
    loader = build_eval_loader(cfg, CPU)
    batches = list(loader)
    assert len(loader) == 3 and [b[0].shape[0] for b in batches] == [8, 8, 4]
    images, labels = batches[0]
    assert images.dtype == torch.float32 and images.shape[1:] == (3, 16, 16)
    assert labels.tolist() == [i % 10 for i in range(8)]
    first = load_image(loader.samples[0].path, loader.preprocess)
    assert torch.equal(images[0], normalize_batch(first.unsqueeze(0), loader.preprocess)[0])
    assert loader.num_samples == 20 and loader.num_classes == 10


def test_loader_with_workers_gives_the_same_batches(list_data: Path) -> None:
    cfg = GlobalConfig(data_dir=str(list_data), batch_size=8, img_size=16, resize_size=16, num_workers=0)
    serial = list(build_eval_loader(cfg, CPU))
    parallel = list(build_eval_loader(dataclasses.replace(cfg, num_workers=2), CPU))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(serial, parallel, strict=True))


def test_max_samples_limits_the_loader(list_data: Path) -> None:
    cfg = GlobalConfig(data_dir=str(list_data), img_size=16, resize_size=16, num_workers=0, max_samples=10)
    loader = build_eval_loader(cfg, CPU)
    assert loader.num_samples == 10 and sorted(s.label for s in loader.samples) == list(range(10))
    assert "subset of 10/20" in loader.layout


def test_missing_data_dir(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"Global\.data_dir .*nowhere does not exist"):
        find_samples(tmp_path / "nowhere")


def test_no_layout_found_hints_at_class_folders(tmp_path: Path) -> None:
    (tmp_path / "n01").mkdir()
    with pytest.raises(DataError, match=r"neither val_list\.txt .*nor val/<class>/.*set data_dir to its parent"):
        find_samples(tmp_path)


def test_list_line_without_label_names_file_and_line(tmp_path: Path) -> None:
    write_images(tmp_path, "list", [0, 1])
    with (tmp_path / "val_list.txt").open("a") as handle:
        handle.write("val/img_0000.png\n")
    with pytest.raises(DataError, match=r"val_list\.txt line 3: 'val/img_0000\.png' has no label"):
        find_samples(tmp_path)


def test_non_integer_label(tmp_path: Path) -> None:
    (tmp_path / "val_list.txt").write_text("a.png cat\n")
    with pytest.raises(DataError, match=r"line 1: label 'cat' is not an integer"):
        find_samples(tmp_path)


def test_missing_image_names_file_and_line(tmp_path: Path) -> None:
    write_images(tmp_path, "list", [0, 1, 2])
    (tmp_path / "val" / "img_0001.png").unlink()
    with pytest.raises(DataError, match=r"val_list\.txt line 2: image .*img_0001\.png does not exist"):
        find_samples(tmp_path)


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_image_names_file_and_line(list_data: Path, workers: int) -> None:
    (list_data / "val" / "img_0012.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    cfg = GlobalConfig(data_dir=str(list_data), batch_size=8, img_size=16, resize_size=16, num_workers=workers)
    loader = build_eval_loader(cfg, CPU)
    with pytest.raises(DataError, match=r"val_list\.txt line 13: image .*img_0012\.png cannot be decoded"):
        list(loader)


def test_label_out_of_range(list_data: Path) -> None:
    samples, layout = find_samples(list_data)
    loader = EvalLoader(samples, layout, Preprocess(16, 16), 8, 0, CPU)
    loader.check_labels(10)
    message = r"line 6: label 5 is outside the model's 5 classes \(valid labels are 0\.\.4, .*up to 9\)"
    with pytest.raises(DataError, match=message):
        loader.check_labels(5)


@pytest.mark.parametrize("resize_size", [232, 256])
def test_equals_torchvision_weights_eval_preset(tmp_path: Path, resize_size: int) -> None:
    # torchvision's pretrained weights are evaluated with ImageClassification(crop 224, resize 232 or 256, bilinear).
    from torchvision.transforms._presets import ImageClassification

    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 256, (300, 410, 3), dtype=np.uint8)).save(tmp_path / "x.jpg", quality=90)
    preset = ImageClassification(crop_size=224, resize_size=resize_size)
    with Image.open(tmp_path / "x.jpg") as image:
        expected = preset(image.convert("RGB"))
    pre = Preprocess(img_size=224, resize_size=resize_size)
    ours = normalize_batch(load_image(str(tmp_path / "x.jpg"), pre).unsqueeze(0), pre)[0]
    assert torch.equal(ours, expected)


# ---- the memory check of image sizes (issue 26) -------------------------------------------------------------------


@pytest.mark.parametrize(("img_size", "resize_size"), [(224, 256), (512, 576), (1024, 1024), (1024, 1146)])
def test_usual_sizes_pass_the_memory_check_on_a_24_gb_machine(img_size: int, resize_size: int) -> None:
    sizes, memory = Preprocess(img_size, resize_size), 24 * 10**9
    for device in ("cpu", "cuda"):
        data_module.check_image_memory(sizes, 256, torch.device(device), available=memory)
    data_module.check_image_memory(sizes, 256, torch.device("cpu"), cached=1024, available=memory)  # calibration


def test_the_memory_check_counts_the_float_copy_only_where_batches_are_normalised() -> None:
    sizes = Preprocess(10_000, 10_000)  # a batch of 8: 2.4 GB uint8, 9.6 GB more as float32
    data_module.check_image_memory(sizes, 8, torch.device("cuda"), available=3 * 10**9)
    with pytest.raises(ConfigError, match=r"Global\.img_size 10000 .*a batch of 8 with its float32 normalised copy"):
        data_module.check_image_memory(sizes, 8, torch.device("cpu"), available=3 * 10**9)


def test_calibration_sizes_that_default_to_the_evaluations_are_named_so() -> None:
    config = GlobalConfig(data_dir="data", img_size=20_000, resize_size=20_000, batch_size=1)
    sizes, keys = calibration.calibration_preprocess(config), calibration.calibration_size_keys(config)
    data_module.check_image_memory(sizes, 1, torch.device("cpu"), available=100 * 10**9)  # the evaluation fits
    with pytest.raises(ConfigError) as raised:
        data_module.check_image_memory(sizes, 1, torch.device("cpu"), cached=1024, keys=keys, available=100 * 10**9)
    assert str(raised.value) == (
        "Global.img_size 20000, which the calibration images use while Global.calib_img_size is unset, makes one "
        "decoded calibration image 1.2 GB (3 x 20000 x 20000 bytes), and the 1024 calibration images decoded once "
        "into RAM and a batch of 1 with its float32 normalised copy need 1.2 TB, more than the 100.0 GB of memory "
        "this machine has available; use a smaller Global.calib_img_size (or fewer Global.calib_samples)."
    )


def test_sizes_that_fit_apart_but_not_together_say_what_they_need_in_all() -> None:
    sizes = Preprocess(1000, 10_000)  # a batch of 8 with its float copy 120 MB, the resized image 400 MB
    with pytest.raises(ConfigError, match=r"^Global\.resize_size 10000 .* 400\.0 MB .*\(520\.0 MB with the decoded"):
        data_module.check_image_memory(sizes, 8, torch.device("cpu"), available=500 * 10**6)
    with pytest.raises(ConfigError, match=r"^Global\.img_size 5000 .*needs 3\.0 GB \(3\.1 GB with the image being"):
        data_module.check_image_memory(Preprocess(5000, 5000), 8, torch.device("cpu"), available=3 * 10**9)


# ---- where the decoded images live, and the batches made from them (issue 30) -------------------------------------

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def decoded_batches(loader: EvalLoader, positions: list[int]) -> Batches:
    """The batches of the samples at ``positions`` computed here, image by image, from the files: what every loader
    path must give, bit for bit."""
    images = torch.stack([load_image(loader.samples[i].path, loader.preprocess) for i in positions])
    labels = torch.tensor([loader.samples[i].label for i in positions])
    size = loader.batch_size
    return [
        (normalize_batch(images[start : start + size], loader.preprocess), labels[start : start + size])
        for start in range(0, len(positions), size)
    ]


def assert_same_batches(got: Batches, expected: Batches) -> None:
    assert len(got) == len(expected)
    for (images, labels), (want_images, want_labels) in zip(got, expected, strict=True):
        assert images.dtype == want_images.dtype and torch.equal(images, want_images)
        assert torch.equal(labels, want_labels)


def loader_config(list_data: Path) -> GlobalConfig:
    return GlobalConfig(data_dir=str(list_data), batch_size=8, img_size=16, resize_size=16, num_workers=0)


def cached_loader(list_data: Path) -> EvalLoader:
    """The 20 images of ``list_data`` in batches of 8, decoded once into RAM."""
    loader = build_eval_loader(loader_config(list_data), CPU)
    loader.cache_in_memory(progress=False)
    return loader


CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("device", "cache_bytes", "free", "share", "free_host", "expected"),
    [
        (CPU, 100, None, 1.0, None, "host"),
        (torch.device("mps"), 100, None, 1.0, None, "host"),
        (CUDA, 100, 200, 0.5, None, "device"),  # exactly the share of the free memory
        (CUDA, 101, 200, 0.5, None, "pinned"),
        (CUDA, 200, 200, 1.0, None, "device"),
        (CUDA, 201, 200, 1.0, None, "pinned"),
        (CUDA, 1, 200, 0.0, None, "pinned"),  # share 0: always host memory
        (CUDA, 0, 200, 0.0, None, "pinned"),
        (CUDA, 100, None, 0.5, None, "pinned"),  # free GPU memory unknown
        (CUDA, 300, 200, 0.5, 512, "pinned"),  # the pinned copy takes 512 bytes, exactly what is available
        (CUDA, 300, 200, 0.5, 511, "host"),
        (CUDA, 100, 200, 0.5, 10, "device"),  # host memory does not matter for GPU memory
    ],
)
def test_cache_placement_decisions(
    device: torch.device, cache_bytes: int, free: int | None, share: float, free_host: int | None, expected: str
) -> None:
    assert cache_placement(device, cache_bytes, free, share, free_host) == expected


def test_pinned_copies_round_up_to_a_power_of_two_and_the_log_says_why() -> None:
    assert [pinned_copy_bytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [1, 1, 2, 4, 4096, 8192]
    gb = 10**9
    assert "at most Global.device_cache_share 0.5 of the 4.00 GB free" in describe_placement("device", gb, 4 * gb, 0.5)
    assert "more than Global.device_cache_share 0.5 of the 1.00 GB free" in describe_placement("pinned", gb, gb, 0.5)
    assert "Global.device_cache_share is 0" in describe_placement("pinned", gb, 4 * gb, 0.0)
    host = describe_placement("host", 3 * gb, gb, 0.5, 2 * gb)
    assert "a pinned copy would take 4.29 GB" in host and "2.00 GB of memory available" in host


def test_the_next_item_is_staged_before_the_current_one_is_used() -> None:
    events: list[str] = []

    def stage(item: int) -> int:
        events.append(f"stage {item}")
        return item * 10

    def finish(staged: int) -> int:
        events.append(f"finish {staged // 10}")
        return staged + 1

    for ready in prefetched(range(3), stage, finish):
        events.append(f"use {ready}")
    assert events == [
        "stage 0", "finish 0", "stage 1", "use 1", "finish 1", "stage 2", "use 11", "finish 2", "use 21",
    ]  # fmt: skip
    assert list(prefetched([], stage, finish)) == []
    assert list(prefetched([7], stage, finish)) == [71]


def test_cached_batches_are_the_decoded_images_in_order(list_data: Path) -> None:
    loader = cached_loader(list_data)
    expected = decoded_batches(loader, list(range(20)))
    assert [len(labels) for _, labels in expected] == [8, 8, 4]
    assert_same_batches(list(loader), expected)
    assert_same_batches(list(loader), expected)  # every pass
    assert_same_batches(list(build_eval_loader(loader_config(list_data), CPU)), expected)  # decoded every pass


def test_cached_batches_in_a_given_order_carry_their_positions(list_data: Path) -> None:
    loader = cached_loader(list_data)
    order = torch.randperm(20, generator=torch.Generator().manual_seed(3)).tolist()
    got = list(loader.in_order(order))
    assert_same_batches([(images, labels) for images, labels, _ in got], decoded_batches(loader, order))
    assert [index.tolist() for _, _, index in got] == [order[:8], order[8:16], order[16:]]
    loader.cached = None  # decoding them again gives the same
    streamed = list(loader.in_order(order))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) for a, b in zip(got, streamed, strict=True))


def test_a_subset_of_cached_images_keeps_their_bytes_and_placement(list_data: Path) -> None:
    loader = cached_loader(list_data)
    subset = loader.subset(7, seed=2)
    positions = [loader.samples.index(sample) for sample in subset.samples]
    assert len(positions) == 7 and subset.cache_placement == "host"
    assert_same_batches(list(subset), decoded_batches(loader, positions))


def test_placing_the_cache_on_the_cpu_changes_nothing(list_data: Path) -> None:
    loader = cached_loader(list_data)
    assert loader.cache_placement == "host"
    assert loader.cached is not None
    images, labels = loader.cached
    before = images.clone()
    assert loader.place_cache(1.0) == "host" and loader.place_cache(0.0) == "host"
    assert loader.cache_placement == "host"
    assert loader.cached[0] is images and loader.cached[1] is labels and torch.equal(images, before)
    assert_same_batches(list(loader), decoded_batches(loader, list(range(20))))


def test_staging_time_adds_up_over_passes_and_measuring_it_changes_no_batch(list_data: Path) -> None:
    loader = cached_loader(list_data)
    assert loader.staging_seconds == 0.0 and not loader.measure_staging
    first = list(loader)
    once = loader.staging_seconds
    assert once > 0
    loader.measure_staging = True
    assert_same_batches(list(loader), first)
    assert loader.staging_seconds > once and loader.staging.measure


def test_a_dropped_loader_is_freed_at_once_with_its_workers(list_data: Path) -> None:
    """No reference cycle keeps a loader (and its persistent decoding workers) alive until the cyclic garbage
    collector runs: one did, and every later test waited 10 s for the orphaned workers' shutdown."""
    cfg = GlobalConfig(data_dir=str(list_data), batch_size=8, img_size=16, resize_size=16, num_workers=1)
    loader = build_eval_loader(cfg, CPU)
    loader.cache_in_memory(progress=False)
    next(iter(loader.loader))  # starts the persistent worker
    gone = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert gone() is None
    finally:
        gc.enable()

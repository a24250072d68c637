"""Plots and the HTML report: documented PNG sizes, real content, self-contained HTML, graceful degradation, and
the report as headless Chromium actually shows it."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from analysis.errors import AnalysisFileError, ConfigError
from analysis.io.results import save_sensitivities, save_sidecar
from analysis.planning.ratios import TargetRatios, get_ratios_by_loss
from analysis.reporting.plots import curves_size, heatmap_size, loss_colouring, plot_curves, savings_size
from analysis.reporting.report import report_paths, write_report

RATIOS = (0.1, 0.2, 0.3, 0.4)
NAMES = [f"stage{i // 3}.block{i % 3}.conv.weight" for i in range(10)]
DENSE_MACS = 1_000_000
MACS_GREEN = (0x4C, 0x9A, 0x6A)  # the MACs-saved bars of the savings plot
UNPRUNABLE_REASON = "coupled to the <b>output</b> layer & never pruned"


def _curve(index: int) -> dict[float, float]:
    """A rising curve per layer, steeper for later layers; layer 3 gains accuracy at ratio 0.1 (loss -0.009)."""
    slope = 0.05 + 0.12 * index
    return {r: round(slope * r * r * 10 - (0.05 if index == 3 and r < 0.3 else 0.0), 6) for r in RATIOS}


def _sidecar(with_costs: bool = True) -> dict[str, Any]:
    params = {}
    for index, name in enumerate(NAMES):
        variants = {}
        for ratio, loss in _curve(index).items():
            record: dict[str, Any] = {
                "loss": loss,
                "top1": 0.9 * (1 - loss),
                "top5": 0.99,
                "ce": 0.3 + loss,
                "images": 200,
                "channels_removed": round(16 * ratio),
                "channels": 16,
                "mode": "mask",
                "seconds": 0.5,
            }
            if with_costs:
                record.update(
                    macs=int(DENSE_MACS * (1 - 0.02 * (index + 1) * ratio)),
                    params=5000,
                    macs_reduction=0.02 * (index + 1) * ratio,
                    params_reduction=0.01 * (index + 1) * ratio,
                )
            variants[f"{ratio:g}"] = record
        params[name] = {
            "module": name.removesuffix(".weight"),
            "shape": [16, 8, 3, 3],
            "group": [f"{name.removesuffix('.weight')} (Conv2d, out)"],
            # layers 0 and 1 share one evaluated variant per ratio: its seconds count once
            "coupled_params": [NAMES[1 - index]] if index < 2 else [],
            "conv_groups": 1,
            "mode": "mask",
            "variants": variants,
        }
    sidecar: dict[str, Any] = {
        "tool": {"name": "prune-sensitivity", "version": "9.8.7"},
        "fingerprint": {
            "model": "ab" * 32,
            "data": "cd" * 32,
            "settings": {
                "criterion": "l1_norm",
                "group_reduction": "self",
                "metric": "top1",
                "metric_mode": "relative",
            },
        },
        "config": {
            "Global": {
                "arch": "resnet18",
                "arch_kwargs": {"num_classes": 10},
                "model_dir": "models",
                "data_dir": "data/val",
            },
            "SensitivityAnalysis": {"pruned_ratios": list(RATIOS), "target_loss": 0.05, "metric": "top1"},
        },
        "params": params,
        "unprunable": {"fc.weight": UNPRUNABLE_REASON},
        "baseline": {"top1": 0.9, "top5": 0.99, "ce": 0.3, "images": 200, "seconds": 1.25},
        "saved_at": "2026-01-02T03:04:05+0000",
    }
    if with_costs:
        sidecar["cost"] = {
            "convention": "MACs of Conv and Linear layers (multiply-accumulates)",
            "macs": DENSE_MACS,
            "params": 50_000,
        }
    return sidecar


def _analysis_file(directory: Path, with_costs: bool = True, sidecar: bool = True) -> Path:
    path = directory / "sensitivity.pkl"
    save_sensitivities(path, {name: _curve(i) for i, name in enumerate(NAMES)})
    if sidecar:
        save_sidecar(path, _sidecar(with_costs))
    return path


def _pixels(png: bytes | Path) -> Image.Image:
    data = png.read_bytes() if isinstance(png, Path) else png
    return Image.open(io.BytesIO(data)).convert("RGB")


def _colour_count(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 2) -> int:
    return sum(
        count
        for count, pixel in image.getcolors(image.width * image.height)
        if max(abs(a - b) for a, b in zip(pixel, colour, strict=True)) <= tolerance
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """One full report (with MACs) shared by the tests that only read it."""
    directory = tmp_path_factory.mktemp("report")
    analysis_file = _analysis_file(directory)
    return analysis_file, write_report(analysis_file)


# ------------------------------------------------------------------------------------------------------- PNGs


def test_pngs_have_the_documented_sizes_and_real_content(report: tuple[Path, Any]) -> None:
    analysis_file, files = report
    assert files == report_paths(analysis_file)
    assert [p.name for p in (files.curves, files.heatmap, files.savings, files.html)] == [
        "sensitivity.curves.png",
        "sensitivity.heatmap.png",
        "sensitivity.savings.png",
        "sensitivity.report.html",
    ]
    # 10 layers -> 2 curve panels side by side (750 x 400 each + 50 px title); heatmap 375 + 75 * 4 = 675 wide,
    # 150 + 25 * 10 = 400 high; savings 1200 wide, 175 + 25 * 10 = 425 rounded up to 425.
    expected = {files.curves: (1500, 450), files.heatmap: (675, 400), files.savings: (1200, 425)}
    assert curves_size(10) == (1500, 450) and heatmap_size(10, 4) == (675, 400) and savings_size(10) == (1200, 425)
    for path, size in expected.items():
        image = _pixels(path)
        assert image.size == size, path.name
        colours = image.getcolors(image.width * image.height)
        assert len(colours) > 50, f"{path.name} looks blank"
        white = sum(count for count, pixel in colours if pixel == (255, 255, 255))
        assert white < 0.95 * image.width * image.height, f"{path.name} is almost all white"
    # The savings plot shows the MACs saved as green bars over a sizable area.
    assert _colour_count(_pixels(files.savings), MACS_GREEN) > 2000


def test_curve_panels_grow_with_the_number_of_layers(tmp_path: Path) -> None:
    curves = {f"l{i}.weight": {0.1: 0.01 * i, 0.5: 0.02 * i} for i in range(20)}
    # 20 layers -> 3 panels of at most 8 -> 2 columns x 2 rows: 1500 x (2 * 400 + 50)
    plot_curves(curves, tmp_path / "c.png", target=TargetRatios.derive(curves, 0.1))
    assert _pixels(tmp_path / "c.png").size == (1500, 850) == curves_size(20)
    assert curves_size(8) == (750, 450) and curves_size(9) == (1500, 450)


def test_rewriting_a_report_gives_identical_bytes_without_a_software_stamp(
    report: tuple[Path, Any], tmp_path: Path
) -> None:
    analysis_file, files = report
    again = write_report(analysis_file, out_dir=tmp_path / "again")
    assert again.html.parent == tmp_path / "again"
    for first, second in zip(
        (files.curves, files.heatmap, files.savings, files.html),
        (again.curves, again.heatmap, again.savings, again.html),
        strict=True,
    ):
        assert first.read_bytes() == second.read_bytes(), first.name
    assert b"Software" not in files.curves.read_bytes()


def test_savings_plot_without_macs_keeps_its_size_and_drops_the_bars(tmp_path: Path) -> None:
    files = write_report(_analysis_file(tmp_path, with_costs=False))
    image = _pixels(files.savings)
    assert image.size == (1200, 425)
    assert _colour_count(image, MACS_GREEN) == 0
    text = files.html.read_text(encoding="utf-8")
    assert "MACs saved at" not in text and "MACs convention" not in text
    assert NAMES[0] in text


def test_loss_colours_are_white_at_zero_red_for_loss_blue_for_gain() -> None:
    cmap, norm = loss_colouring([-0.2, 0.0, 0.4])
    red, green, blue, _ = cmap(norm(0.0))
    assert min(red, green, blue) > 0.9
    red, _, blue, _ = cmap(norm(0.4))
    assert red > 0.3 > blue
    red, _, blue, _ = cmap(norm(-0.2))
    assert blue > red
    # Without gains the whole scale is white to red.
    cmap, norm = loss_colouring([0.0, 0.4])
    assert norm(0.0) == 0.0 and min(cmap(norm(0.0))[:3]) > 0.9


# ------------------------------------------------------------------------------------------------------- HTML


def test_html_is_self_contained_and_lists_names_ratios_and_costs(report: tuple[Path, Any]) -> None:
    _, files = report
    text = files.html.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "<script" not in text
    sources = re.findall(r'src="([^"]*)"', text)
    assert len(sources) == 3 and all(s.startswith("data:image/png;base64,") for s in sources)
    embedded = [base64.b64decode(s.split(",", 1)[1]) for s in sources]
    assert embedded == [files.curves.read_bytes(), files.heatmap.read_bytes(), files.savings.read_bytes()]
    assert not re.search(r"""(?:href|src)\s*=\s*["']?(?!["']|data:|#)""", text)
    for name in NAMES:
        assert f">{name}<" in text
    # Model order in the table follows the file.
    positions = [text.index(f">{name}<") for name in NAMES]
    assert positions == sorted(positions)
    # target_loss defaults to the run's (0.05): each derived ratio appears in the table.
    for ratio in get_ratios_by_loss({n: _curve(i) for i, n in enumerate(NAMES)}, 0.05).values():
        assert f">{ratio:.4f}<" in text
    assert "ratio at target 0.05" in text
    # MACs saved at the largest ratio (0.4) for layer 10: 0.02 * 10 * 0.4 = 8.00%
    assert "MACs saved at 0.4" in text and ">8.00%<" in text
    assert "MACs of Conv and Linear layers (multiply-accumulates)" in text
    assert "relative top1 loss = (baseline top1 - pruned top1) / |baseline top1|" in text
    assert "resnet18" in text and "data/val" in text and "9.8.7" in text and "2026-01-02T03:04:05+0000" in text
    # 10 layers x 4 ratios x 0.5 s, minus the 4 variants layers 0 and 1 share: 18.0 s
    assert "18.0 s summed over variants (+ 1.2 s baseline)" in text
    # Text from files is escaped, never markup.
    assert "&lt;b&gt;output&lt;/b&gt; layer &amp; never pruned" in text and "<b>output</b>" not in text


def test_explicit_target_and_ratio_change_the_table(tmp_path: Path) -> None:
    analysis_file = _analysis_file(tmp_path)
    files = write_report(analysis_file, out_dir=tmp_path / "out", target_loss=0.2, ratio=0.2)
    text = files.html.read_text(encoding="utf-8")
    assert "ratio at target 0.2" in text and "MACs saved at 0.2" in text
    # layer 10 at ratio 0.2 saves 0.02 * 10 * 0.2 = 4.00%
    assert ">4.00%<" in text
    with pytest.raises(ConfigError, match=r"0\.25 was not analysed"):
        write_report(analysis_file, out_dir=tmp_path / "bad", ratio=0.25)


def test_report_without_a_sidecar_shows_the_losses_alone(tmp_path: Path) -> None:
    files = write_report(_analysis_file(tmp_path, sidecar=False), target_loss=0.05)
    text = files.html.read_text(encoding="utf-8")
    assert "No sidecar (sensitivity.pkl.json)" in text
    assert all(f">{name}<" in text for name in NAMES)
    assert "ratio at target 0.05" in text
    assert _pixels(files.heatmap).size == (675, 400)


def test_empty_or_missing_analysis_file_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pkl"
    save_sensitivities(empty, {})
    with pytest.raises(AnalysisFileError, match=r"empty\.pkl holds no measured losses"):
        write_report(empty)
    with pytest.raises(AnalysisFileError, match=r"missing\.pkl does not exist"):
        write_report(tmp_path / "missing.pkl")
    assert not list(tmp_path.glob("*.png"))


# ---------------------------------------------------------------------------------------------------- Chromium


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _screenshot(binary: str, html_file: Path, out: Path) -> Image.Image:
    """Render ``html_file`` in headless Chromium at 1600 x 3000 CSS pixels, scale 1, so images show 1:1."""
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={out.parent / 'chromium-profile'}",
        "--window-size=1600,3000",
        f"--screenshot={out}",
        html_file.resolve().as_uri(),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=180)
    return Image.open(out).convert("RGB")


def _white_png(size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, "white").save(buffer, format="PNG")
    return buffer.getvalue()


def test_chromium_shows_the_embedded_plots(report: tuple[Path, Any], tmp_path: Path) -> None:
    binary = _chromium()
    if binary is None:
        if os.environ.get("REQUIRE_CHROMIUM") == "1":
            pytest.fail("REQUIRE_CHROMIUM=1 but no chromium binary is on PATH")
        pytest.skip("chromium is not installed")
    _, files = report
    text = files.html.read_text(encoding="utf-8")
    pngs = {path.name: path.read_bytes() for path in (files.curves, files.heatmap, files.savings)}
    # Control page: the same layout (img width/height attributes) with blank images of the same sizes.
    control = text
    for png in pngs.values():
        control = control.replace(
            base64.b64encode(png).decode("ascii"),
            base64.b64encode(_white_png(_pixels(png).size)).decode("ascii"),
        )
    assert control != text
    control_file = tmp_path / "control.html"
    control_file.write_text(control, encoding="utf-8")
    shown = Counter(dict((c, n) for n, c in _screenshot(binary, files.html, tmp_path / "shown.png").getcolors(10**8)))
    blank = Counter(dict((c, n) for n, c in _screenshot(binary, control_file, tmp_path / "blank.png").getcolors(10**8)))
    for name, png in pngs.items():
        image = _pixels(png)
        colours = Counter(dict((c, n) for n, c in image.getcolors(image.width * image.height)))
        del colours[(255, 255, 255)]
        # Each plot's most frequent colours appear on screen (beyond what the rest of the page has) about as often
        # as in the PNG itself: the image was decoded and drawn at its own size.
        for colour, count in colours.most_common(4):
            assert shown[colour] - blank[colour] >= 0.9 * count, f"{name}: colour {colour} not shown"
    assert shown[MACS_GREEN] - blank[MACS_GREEN] > 2000

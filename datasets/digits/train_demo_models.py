"""Train the two digits demo models and save their state_dicts under ``datasets/digits/weights/``.

    pip install -e . && python datasets/digits/train_demo_models.py

Training images go through the tool's own decoding (``analysis.inputs.data.load_image``) at 32x32 plus a random 28x28
crop (+-2 px shifts); the reported val top1 comes from the tool's own evaluation of ``configs/demo/*.yaml``, so the
number printed here is the number ``run.py`` prints. Seeded; a couple of minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from analysis.config import load_config  # noqa: E402
from analysis.engine.evaluate import evaluate  # noqa: E402
from analysis.inputs.data import Preprocess, build_eval_loader, find_samples, load_image, normalize_batch  # noqa: E402
from analysis.inputs.models import create_architecture  # noqa: E402

MODELS = {  # demo config -> weights file written by this script
    "configs/demo/digits_resnet.yaml": "digits_resnet.pth",
    "configs/demo/digits_mobilenet.yaml": "digits_mobilenet_v2.pth",
}


def load_train_set(data_dir: Path, preprocess: Preprocess) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode every training image once at the full 32x32 (no crop) as uint8, with its label."""
    samples, _ = find_samples(data_dir, "train_list.txt")
    full = Preprocess(preprocess.resize_size, preprocess.resize_size, preprocess.interpolation)
    images = torch.stack([load_image(s.path, full) for s in samples])
    return images, torch.tensor([s.label for s in samples])


def random_crops(images: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """Crop each uint8 image at a random offset (the eval crop is the centred one)."""
    slack = images.shape[-1] - size
    offsets = torch.randint(0, slack + 1, (images.shape[0], 2), generator=generator)
    return torch.stack(
        [img[:, y : y + size, x : x + size] for img, (y, x) in zip(images, offsets.tolist(), strict=True)]
    )


def train(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, preprocess: Preprocess, epochs: int, seed: int
) -> None:
    """SGD with momentum, cosine learning rate, label smoothing; deterministic for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    batch_size = 64
    steps = epochs * math.ceil(len(images) / batch_size)
    warmup = math.ceil(len(images) / batch_size)  # one epoch of linear warm-up keeps MobileNetV2 from diverging

    def learning_rate_factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_factor)
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        total = 0.0
        for start in range(0, len(images), batch_size):
            index = order[start : start + batch_size]
            batch = normalize_batch(random_crops(images[index], preprocess.img_size, generator), preprocess)
            loss = F.cross_entropy(model(batch), labels[index], label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            schedule.step()
            total += float(loss.detach()) * len(index)
        if (epoch + 1) % 10 == 0:
            print(f"  epoch {epoch + 1}/{epochs}: train loss {total / len(images):.4f}", flush=True)
    model.eval()


def main(argv: list[str] | None = None) -> None:
    """Train each demo model, evaluate it with the tool's own loader, save its weights."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out_dir = HERE / "weights"
    out_dir.mkdir(exist_ok=True)
    for config_path, filename in MODELS.items():
        config = load_config(REPO / config_path).Global
        preprocess = Preprocess.from_config(config)
        images, labels = load_train_set(REPO / config.data_dir, preprocess)
        torch.manual_seed(args.seed)
        model = create_architecture(config.arch, config.arch_kwargs)
        start = time.perf_counter()
        print(f"{config_path}: training {config.arch} on {len(images)} images", flush=True)
        train(model, images, labels, preprocess, args.epochs, args.seed)
        seconds = time.perf_counter() - start
        config.data_dir = str(REPO / config.data_dir)
        result = evaluate(model, build_eval_loader(config, torch.device("cpu")), progress=False)
        path = out_dir / filename
        torch.save(model.state_dict(), path)
        params = sum(p.numel() for p in model.parameters())
        print(
            f"{config_path}: val {result.summary()}; {params / 1e6:.3f} M params; trained in {seconds:.0f} s; "
            f"{path.relative_to(REPO)} {path.stat().st_size / 1e6:.2f} MB",
            flush=True,
        )


if __name__ == "__main__":
    main()

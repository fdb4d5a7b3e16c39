"""CIFAR ResNet-20 (He et al. 2016, §4.2) with GroupNorm in place of BatchNorm.

The Clip21 paper's CIFAR-10 runs use a ResNet-20; we take the CIFAR-style one (about 0.27M
parameters). BatchNorm mixes the samples of a batch, which breaks per-sample gradients and is
outside every DP analysis, so each BatchNorm becomes a GroupNorm with the same affine parameters (2
per channel): the parameter count is the paper's 269,722 for 10 classes. Shortcuts that change shape
use option A of the paper (subsample, zero-pad the new channels), which has no parameters.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class _PadShortcut(nn.Module):
    """Option-A shortcut: stride-2 subsampling and zero channels up to ``planes``."""

    def __init__(self, extra_channels: int) -> None:
        super().__init__()
        self.extra = extra_channels

    def forward(self, x: Tensor) -> Tensor:
        half = self.extra // 2
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, half, self.extra - half))


class BasicBlock(nn.Module):
    """conv3x3 → GN → ReLU → conv3x3 → GN, plus the shortcut, then ReLU."""

    def __init__(self, in_planes: int, planes: int, stride: int, norm_groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(norm_groups, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(norm_groups, planes)
        self.shortcut = _PadShortcut(planes - in_planes) if stride != 1 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """3 stages × 3 basic blocks with 16, 32, 64 channels; global average pool; linear head.

    Parameters
    ----------
    in_channels : int
        Image channels (3 for CIFAR-10).
    num_classes : int
        Logits.
    norm_groups : int, default 2
        GroupNorm groups in every norm layer (must divide 16).
    """

    def __init__(self, in_channels: int, num_classes: int, norm_groups: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(norm_groups, 16)
        blocks: list[nn.Module] = []
        in_planes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(BasicBlock(in_planes, planes, stride if i == 0 else 1, norm_groups))
                in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: Tensor) -> Tensor:
        out = self.blocks(F.relu(self.norm(self.conv(x))))
        return self.head(out.mean(dim=(2, 3)))

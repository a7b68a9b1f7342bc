"""Models the training-step benchmarks share (ddp_step.py, horovod_synthetic.py): ResNets built
from torchvision's BasicBlock layout, without torchvision (its wheel may not match the CPU torch)."""
from __future__ import annotations


def resnet(stem: list, stages, classes: int = 10):
    """``stem`` layers, then for each ``(channels, stride, blocks)`` stage that many basic blocks,
    then global average pooling and a linear classifier."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.b1(self.c1(x)).relu()
            return (self.b2(self.c2(y)) + self.skip(x)).relu()

    layers, cin = list(stem), stem[0].out_channels
    for cout, stride, blocks in stages:
        for i in range(blocks):
            layers.append(Block(cin, cout, stride if i == 0 else 1))
            cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def resnet18(classes: int = 10):
    """ResNet-18 (BasicBlock x [2, 2, 2, 2], 11.2 M parameters)."""
    import torch.nn as nn
    stem = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    return resnet(stem, ((64, 1, 2), (128, 2, 2), (256, 2, 2), (512, 2, 2)), classes)


def small_resnet(classes: int = 10):
    """A small ResNet for 32x32 images on CPU: one block per stage, 16-128 channels."""
    import torch.nn as nn
    stem = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    return resnet(stem, ((16, 1, 1), (32, 2, 1), (64, 2, 1), (128, 2, 1)), classes)

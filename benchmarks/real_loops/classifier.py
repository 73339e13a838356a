"""A classifier written as pytorch/examples' mnist/main.py writes it: ``output = model(data)``, then
``F.nll_loss(output, target)``, and a test pass under ``torch.no_grad()`` after every epoch. Only the
``with guard`` line is added."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(torch.flatten(x, 1))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Net()
    return model, torch.optim.Adadelta(model.parameters(), lr=1.0)


class loader:  # noqa: N801 (a DataLoader's part: one batch made at a time, as its iterator does)
    def __init__(self, seed: int, batches: int) -> None:
        self.seed, self.batches = seed, batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.batches):
            yield torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    train_loader, test_loader = loader(0, steps // 2), loader(1, 2)
    test_loss = 0.0
    for _epoch in range(2):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
        model.eval()
        test_loss = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                test_loss += F.nll_loss(model(data), target, reduction="sum").item()
    return test_loss

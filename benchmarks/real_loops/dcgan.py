"""pytorch/examples' dcgan/main.py: a Generator and a Discriminator, two Adam optimizers, the losses
computed outside the models (``criterion(output, label)``), ``netD(fake.detach())`` for D's step and
``netD(fake)`` for G's. Small widths (ngf = ndf = 8) on 64×64 images. The two models go to the guard in
one container, with both optimizers; the loop itself is unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

NZ, NGF, NDF, NC = 16, 8, 8, 3


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(NGF * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 8, NGF * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NGF * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 4, NGF * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NGF),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, NDF * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 4, NDF * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


def build() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    netG, netD = Generator(), Discriminator()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    return nn.ModuleDict({"netG": netG, "netD": netD}), [optimizerD, optimizerG]


class loader:  # noqa: N801 (a DataLoader's part: one batch made at a time, as its iterator does)
    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        g = torch.Generator().manual_seed(0)
        for _ in range(self.batches):
            yield torch.rand(8, NC, 64, 64, generator=g) * 2 - 1, 0


def train(models: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int) -> float:
    netG, netD = models["netG"], models["netD"]
    optimizerD, optimizerG = optimizers
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    dataloader = loader(steps)
    errG = torch.zeros(())
    for _i, data in enumerate(dataloader, 0):
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        noise = torch.randn(batch_size, NZ, 1, 1)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        errD = errD_real + errD_fake  # noqa: F841 (the script prints it)
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        optimizerG.step()
    return float(errG.detach())

"""A word language model written as pytorch/examples' word_language_model writes it: an ``RNNModel``
(embedding, ``nn.LSTM`` with ``batch_first=False``, decoder, ``log_softmax``), ``batchify``'d
``(seq, batch)`` token ids, flat targets, the hidden state carried and repackaged, ``model.zero_grad()``,
``nn.NLLLoss``, gradient clipping and the manual SGD update ``p.data.add_(p.grad, alpha=-lr)``: no
optimizer object. Only the ``with guard(model, None):`` line is added (``build`` returns ``None`` for it)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

NTOKEN, EMSIZE, NHID, NLAYERS, DROPOUT = 4096, 64, 64, 2, 0.2
BPTT, BATCH_SIZE, LR, CLIP = 35, 20, 20.0, 0.25


class RNNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(DROPOUT)
        self.encoder = nn.Embedding(NTOKEN, EMSIZE)
        self.rnn = nn.LSTM(EMSIZE, NHID, NLAYERS, dropout=DROPOUT)
        self.decoder = nn.Linear(NHID, NTOKEN)

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):  # type: ignore[no-untyped-def]
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, NTOKEN)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (weight.new_zeros(NLAYERS, bsz, NHID), weight.new_zeros(NLAYERS, bsz, NHID))


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(BPTT, len(source) - 1 - i)
    data = source[i : i + seq_len]
    target = source[i + 1 : i + 1 + seq_len].view(-1)
    return data, target


def repackage_hidden(h):  # type: ignore[no-untyped-def]
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def build() -> tuple[nn.Module, None]:
    return RNNModel(), None


def train(model: nn.Module, optimizer: None, steps: int) -> float:
    g = torch.Generator().manual_seed(1111)
    corpus = torch.randint(0, NTOKEN, (BATCH_SIZE * (steps * BPTT + 1),), generator=g)
    train_data = batchify(corpus, BATCH_SIZE)
    criterion = nn.NLLLoss()
    model.train()
    hidden = model.init_hidden(BATCH_SIZE)
    for _batch, i in enumerate(range(0, train_data.size(0) - 1, BPTT)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)
    return loss.item()

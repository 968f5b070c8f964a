"""The Python snippets of README.md and docs/**/*.md, and the small world each one runs in.

Every ```python block must be preceded by a marker line ``<!-- doc-test: CONTEXT -->`` naming the
context it runs in (tests/test_docs.py fails on a block without one):

- ``standalone``: nothing is defined beforehand.
- ``training``: the names a snippet takes for granted (``model``, ``opt``, ``sched``, ``scaler``,
  ``loader``, ``dataset``, ``build()``, ``build_model()``, ``train_step()``, ``state``, ``latest``,
  ``epochs``, ``total_steps``, ...) are defined by :data:`TRAINING_PRELUDE`: a small MLP on
  synthetic data, with dropout and a shuffled loader so that an inexact resume would show.
- ``kill-resume``: as ``training``, and the snippet is a whole training program: it is run once
  uninterrupted, once killed with SIGKILL after its second checkpoint, and once more to resume;
  the resumed run must start from a checkpoint and end bit-identical to the uninterrupted one.
- ``distributed``: as ``training``, inside a one-rank gloo process group (its own process).
- ``s3``: as ``training``, against the test SeaweedFS server: ``opts`` are its storage options,
  the bucket ``ckpt`` of the snippet is a fresh bucket, and local paths under ``/dev/shm/`` go
  under the test's directory instead (:data:`S3_SUBSTITUTIONS`).
- ``lightning``: ``import lightning as L``, ``model`` (a tiny LightningModule with dropout and a
  shuffled loader of 4 batches an epoch) and ``ModelCheckpoint`` are defined by
  :data:`LIGHTNING_PRELUDE`; skipped where the ``lightning`` package is not installed.
- ``transformers``: ``model`` (a tiny GPT-2 built from its config, no download), ``dataset`` (16
  token sequences) and ``TrainingArguments`` are defined by :data:`TRANSFORMERS_PRELUDE`; skipped
  where the ``transformers`` package is not installed.
- ``accelerate``: ``model`` (with dropout), ``optimizer``, ``scheduler``, ``loader`` (shuffled,
  8 batches an epoch), ``Counter`` (a custom object) and ``os`` are defined by
  :data:`ACCELERATE_PRELUDE`; skipped where ``accelerate`` or ``torchdata`` is not installed.
- ``torchtitan``: a job config function (a config_registry entry); :data:`TORCHTITAN_EPILOGUE`
  builds its config and checks that the Trainer would build resurgo's checkpoint manager. Marked
  ``torchtitan`` (torchtitan lives outside the environment: ``make test-torchtitan``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/, at any depth: a new page is covered without a change here."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


DOCS = doc_files()
CONTEXTS = ("standalone", "training", "kill-resume", "distributed", "s3", "lightning", "transformers", "accelerate",
            "torchtitan")
MARKER = re.compile(r"^<!-- doc-test: ([a-z0-9-]+) -->$")


@dataclass(frozen=True)
class Snippet:
    file: Path
    line: int  # of the opening fence, 1-based
    context: str | None  # None: no marker
    code: str

    @property
    def name(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def snippets(files: list[Path] = DOCS) -> list[Snippet]:
    found = []
    for f in files:
        lines = f.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i
                m = MARKER.match(lines[i - 1].strip()) if i > 0 else None
                i += 1
                body = []
                while i < len(lines) and lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                found.append(Snippet(f, start + 1, m.group(1) if m else None, "\n".join(body) + "\n"))
            i += 1
    return found


# Runs before a snippet of every context but "standalone". It must stay deterministic from its
# seed: the kill-and-resume comparison relies on it.
TRAINING_PRELUDE = '''
import glob
import os
import signal

import torch
import resurgo
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
epochs = 5                       # 64 batches of 8 per epoch: 320 steps
total_steps = 320
val_loss = 0.5


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def build():
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    return model, opt, sched, DataLoader(dataset, batch_size=8, shuffle=True)


def find_latest(root):
    found = sorted(glob.glob(os.path.join(root, "step_*")))
    return found[-1] if found else None


model, opt, sched, loader = build()
scaler = torch.amp.GradScaler("cpu", enabled=False)
state = resurgo.TrainState(model=model, optimizer=opt, scheduler=sched, step=0)
latest = find_latest("ckpt")

_KILL_AT = int(os.environ.get("DOC_TEST_KILL_AT", "0"))  # SIGKILL at this train_step call (0: never)
_calls = 0
first_step = None  # the step the first train_step of this process ran at (after any resume)


def train_step(batch=None):
    """One optimizer step; without a batch it draws one from the (checkpointed) torch RNG."""
    global _calls, first_step
    _calls += 1
    if _calls == _KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    if first_step is None:
        first_step = state.step
    x, y = batch if batch is not None else (torch.randn(8, 8), torch.randint(0, 2, (8,)))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()
'''

# Appended to a kill-resume snippet: what the comparison reads.
KILL_RESUME_EPILOGUE = '''
torch.save({"first_step": first_step, "step": state.step, "model": model.state_dict(),
            "optimizer": opt.state_dict()}, os.environ["DOC_TEST_OUT"])
'''

DISTRIBUTED_PRELUDE = '''
import os
import torch.distributed as dist

dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["DOC_TEST_PORT"])
'''

DISTRIBUTED_EPILOGUE = '''
dist.destroy_process_group()
'''

S3_SUBSTITUTIONS = (("s3://ckpt/", "s3://{bucket}/"), ("/dev/shm/", "{tmp}/shm/"))


LIGHTNING_PRELUDE = '''
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

L.seed_everything(0)


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


model = Tiny()
'''


TRANSFORMERS_PRELUDE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8))
tokens = torch.randint(0, 32, (16, 8))
dataset = [{"input_ids": t, "labels": t} for t in tokens]
'''


ACCELERATE_PRELUDE = '''
import os

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


class Counter:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]
'''


TORCHTITAN_EPILOGUE = '''
_configs = [v() for k, v in list(globals().items()) if callable(v) and getattr(v, "__module__", None) == __name__
            and k.startswith("llama3")]
assert _configs, "the snippet defines no job config function"
for _config in _configs:
    assert _config.checkpoint.enable and type(_config.checkpoint) is ResurgoCheckpointManager.Config
    assert _config.checkpoint._owner is ResurgoCheckpointManager  # what Trainer's config.checkpoint.build() makes
'''

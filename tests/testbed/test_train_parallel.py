"""Training the draft in its own process gives the very weights it gets when trained in turn with the target.

``testbed.train`` trains the two models side by side (the draft in a spawned process) to halve the wall
time; the recorded sweeps and the cache's meaning rest on that changing no bit. Runs a few steps of tiny
models in the engine environment (torch lives only there), both ways, and compares every tensor exactly.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from testbed import env

pytestmark = pytest.mark.engines

SCRIPT = r"""
import json, sys
import torch
from testbed import train

recipe = json.loads(sys.argv[1])
torch.set_num_threads(recipe["threads"])


class Ids:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0


def fresh(seed):
    torch.manual_seed(seed)
    return train.build_model(recipe["draft"], 64, Ids())


data = torch.Generator().manual_seed(7)
inputs = torch.randint(3, 64, (24, 16), generator=data)
labels = inputs.clone()
labels[:, :4] = -100

in_turn = fresh(recipe["seed"])
turn_losses = train._train_in_place("draft", in_turn, inputs, labels, recipe, 0.0)

if __name__ == "__main__":
    import multiprocessing
    start = fresh(recipe["seed"])
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        spawned_state, spawned_losses = pool.apply(
            train.train_model, ("draft", start.state_dict(), start.config, inputs, labels, recipe))
    other = fresh(recipe["seed"] + 1)
    train._train_in_place("draft", other, inputs, labels, recipe, 0.0)

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    print(json.dumps({
        "spawned_equal": same(in_turn.state_dict(), spawned_state),
        "losses_equal": turn_losses == spawned_losses,
        "other_seed_equal": same(in_turn.state_dict(), other.state_dict()),
        "steps": len(spawned_losses),
    }))
"""


def test_draft_trained_in_a_spawned_process_has_the_same_bits() -> None:
    python = env.ensure_env(quiet=True)
    recipe = {"seed": 11, "threads": 1, "steps": 8, "warmup_steps": 2, "batch_size": 4,
              "draft": {"hidden": 64, "layers": 1, "heads": 2, "intermediate": 128, "lr": 4e-3}}
    result = subprocess.run([str(python), "-c", SCRIPT, json.dumps(recipe)], capture_output=True, text=True,
                            env=env.engine_env(), timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdict == {"spawned_equal": True, "losses_equal": True, "other_seed_equal": False, "steps": 8}

"""Train the testbed's tokenizer, target and draft models. Runs in the engine environment.

``python -m testbed.train --out DIR --recipe FILE.json`` (``testbed.models``
runs it). Both models see identical batches, so the draft imitates the target
where the data is predictable and cannot where it is not. Writes
``DIR/target``, ``DIR/draft`` (Hugging Face layout, safetensors, tokenizer
next to each) and ``DIR/report.json`` (timings, losses, and how well the
target copies and the drafters would be accepted, measured greedily).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import sys
import time
from pathlib import Path
from typing import Any

from testbed import corpus

# torch, tokenizers and transformers exist only in the engine environment: imported inside functions.


# GPT-2's pre-tokenization, except that a JSON key with its quotes and colon (``"city":"``) stays one piece,
# so it becomes one token, the same in the record and in the answer: the token after it in the record is the
# value to copy, which is what an induction head (and n-gram speculation) finds.
PRE_TOKENIZE = r'"[a-z]+":"|\s?[a-zA-Z]+|\s?[0-9]+|\s?[^\sa-zA-Z0-9"]+|"|\s+'


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(corpus.SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=corpus.USER, eos_token=corpus.END,
                                   pad_token=corpus.PAD, chat_template=corpus.CHAT_TEMPLATE,
                                   model_max_length=1024, clean_up_tokenization_spaces=False)


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int,
         pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Whole (input ids, labels) examples per row, never cut (a cut record could not be copied from);
    padding is not learned."""
    rows: list[list[int]] = []
    labels: list[list[int]] = []
    row: list[int] = []
    row_labels: list[int] = []
    for ids, lab in examples:
        if len(ids) > seq_len:
            continue
        if len(row) + len(ids) > seq_len:
            rows.append(row + [pad_id] * (seq_len - len(row)))
            labels.append(row_labels + [-100] * (seq_len - len(row)))
            row, row_labels = [], []
        row = row + ids
        row_labels = row_labels + lab
    if row:
        rows.append(row + [pad_id] * (seq_len - len(row)))
        labels.append(row_labels + [-100] * (seq_len - len(row)))
    return rows, labels


def encode(tok: Any, example: corpus.Example, mask_prompt: bool) -> tuple[list[int], list[int]]:
    """Token ids of the training text and their labels. With ``mask_prompt`` only the answer is learned:
    prompts are random records the model cannot predict, and learning them would drown the copying signal."""
    text = example.text()
    head = text[:text.index(corpus.ASSISTANT) + len(corpus.ASSISTANT)]
    # The assistant marker is a special token, so the two halves tokenize as the whole does.
    prompt_ids = tok(head, add_special_tokens=False)["input_ids"]
    answer_ids = tok(text[len(head):], add_special_tokens=False)["input_ids"]
    labels = ([-100] * len(prompt_ids) if mask_prompt else list(prompt_ids)) + list(answer_ids)
    return list(prompt_ids) + list(answer_ids), labels


def build_model(spec: dict[str, Any], vocab: int, tok: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                         num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["heads"], max_position_embeddings=1024, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, torch_dtype="float32")
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(name: str, state: dict[str, Any], config: Any, inputs_all: Any, labels_all: Any,
                recipe: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
    """Train one model from the given initial weights in this (spawned) process; its final weights and losses."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(recipe["threads"])
    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    losses = _train_in_place(name, model, inputs_all, labels_all, recipe, time.monotonic())
    return model.state_dict(), losses


def _train_in_place(name: str, model: Any, inputs_all: Any, labels_all: Any, recipe: dict[str, Any],
                    t_start: float) -> list[float]:
    """AdamW with warm-up and cosine decay on batches drawn by the recipe's seed: both models see the same."""
    import torch

    optim = torch.optim.AdamW(model.parameters(), lr=recipe[name]["lr"], betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(recipe["seed"])
    steps, bs = recipe["steps"], recipe["batch_size"]
    losses: list[float] = []
    order = torch.randperm(len(inputs_all), generator=gen)
    cursor = 0
    model.train()
    for step in range(steps):
        if cursor + bs > len(order):
            order = torch.randperm(len(inputs_all), generator=gen)
            cursor = 0
        idx = order[cursor:cursor + bs]
        cursor += bs
        for group in optim.param_groups:
            group["lr"] = lr_at(step, steps, recipe["warmup_steps"], recipe[name]["lr"])
        loss = model(input_ids=inputs_all[idx], labels=labels_all[idx]).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0 or step == steps - 1:
            print(f"{name} step {step:4d}  loss {losses[-1]:.3f}  {time.monotonic() - t_start:.0f}s",
                  file=sys.stderr, flush=True)
    return losses


def prompt_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """What n-gram (prompt look-up) speculation would propose after ``tokens``: the longest suffix match wins."""
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def evaluate(target: Any, draft: Any, tok: Any, recipe: dict[str, Any]) -> dict[str, Any]:
    """Greedy answers of the target on held-out requests; copy accuracy; estimated acceptance per route."""
    import torch

    target.eval()
    draft.eval()
    report: dict[str, Any] = {}
    n = recipe["eval_requests"]
    k = 4
    with torch.no_grad():
        for route in corpus.ROUTES:
            examples = corpus.requests(route, n, recipe["seed"])
            exact = fields_ok = fields_total = 0
            ng_drafted = ng_accepted = 0
            agree = positions = 0
            for ex in examples:
                prompt_ids = tok.apply_chat_template([{"role": "user", "content": ex.prompt}],
                                                     add_generation_prompt=True, tokenize=True)
                if not isinstance(prompt_ids, list):
                    prompt_ids = list(prompt_ids["input_ids"])
                ids = torch.tensor([prompt_ids])
                out = target.generate(ids, max_new_tokens=96, do_sample=False, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id)
                gen = out[0, len(prompt_ids):].tolist()
                text = tok.decode(gen, skip_special_tokens=True)
                exact += int(text == ex.completion)
                if route == "extract":
                    want = json.loads(ex.completion)
                    try:
                        got = json.loads(text)
                    except ValueError:
                        got = {}
                    got = got if isinstance(got, dict) else {}
                    fields_total += len(want)
                    fields_ok += sum(1 for key, value in want.items() if got.get(key) == value)
                # n-gram: walk the greedy answer as the engine would, one verification step at a time.
                seq = list(prompt_ids)
                pos = 0
                while pos < len(gen):
                    proposal = prompt_lookup(seq, k, 3, 1)
                    accepted = 0
                    for t in proposal:
                        if pos + accepted < len(gen) and gen[pos + accepted] == t:
                            accepted += 1
                        else:
                            break
                    ng_drafted += len(proposal)
                    ng_accepted += accepted
                    step = accepted + 1
                    seq.extend(gen[pos:pos + step])
                    pos += step
                # draft: how often its greedy next token equals the target's, on the target's own answer.
                logits = draft(out).logits[0, len(prompt_ids) - 1:-1]
                agree += int((logits.argmax(-1) == out[0, len(prompt_ids):]).sum())
                positions += len(gen)
            report[route] = {
                "exact_match": exact / n,
                "ngram_acceptance_est": ng_accepted / ng_drafted if ng_drafted else None,
                "draft_token_agreement": agree / positions if positions else None,
            }
            if route == "extract":
                report[route]["fields_copied"] = fields_ok / fields_total if fields_total else None
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.train")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", type=Path, required=True, help="JSON file of the recipe")
    args = parser.parse_args(argv)
    recipe = json.loads(args.recipe.read_text())

    import torch

    t_start = time.monotonic()
    torch.set_num_threads(recipe["threads"])
    random.seed(recipe["seed"])
    torch.manual_seed(recipe["seed"])

    examples = corpus.generate(recipe["seed"], recipe["examples"], recipe["mix"])
    texts = [ex.text() for ex in examples]
    tok = train_tokenizer(texts, recipe["vocab_size"])
    t_tok = time.monotonic()
    encoded = [encode(tok, ex, recipe["mask_prompt"]) for ex in examples]
    rows, labels = pack(encoded, recipe["seq_len"], tok.pad_token_id)
    inputs_all = torch.tensor(rows)
    labels_all = torch.tensor(labels)
    vocab = len(tok)

    models = {name: build_model(recipe[name], vocab, tok) for name in ("target", "draft")}
    # The models never interact while training, so each gets a core: the draft in a spawned process, the
    # target here. Each side runs exactly the single-threaded steps it ran when they took turns, so the
    # weights are the same bits, in about the target's time alone.
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(1) as pool:
        draft_job = pool.apply_async(train_model, ("draft", models["draft"].state_dict(), models["draft"].config,
                                                   inputs_all, labels_all, recipe))
        losses = {"target": _train_in_place("target", models["target"], inputs_all, labels_all, recipe, t_start)}
        draft_state, losses["draft"] = draft_job.get()
    models["draft"].load_state_dict(draft_state)
    t_train = time.monotonic()

    args.out.mkdir(parents=True, exist_ok=True)
    for name, model in models.items():
        model.eval()
        model.generation_config.do_sample = False
        model.save_pretrained(args.out / name, safe_serialization=True)
        tok.save_pretrained(args.out / name)
    quality = evaluate(models["target"], models["draft"], tok, recipe)
    t_end = time.monotonic()
    report = {
        "seconds": {"tokenizer": round(t_tok - t_start, 1), "train": round(t_train - t_tok, 1),
                    "eval": round(t_end - t_train, 1), "total": round(t_end - t_start, 1)},
        "rows": len(rows), "tokens_per_row": recipe["seq_len"], "vocab": vocab,
        "parameters": {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()},
        "final_loss": {name: round(sum(v[-20:]) / len(v[-20:]), 4) for name, v in losses.items()},
        "quality": quality,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

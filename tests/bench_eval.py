"""A checkpoint's held-out greedy accuracy on a task, by the engine and by transformers.

The held-out prompts are train.py's evaluation split (tasks.eval_split with the run's --seed and
--eval_prompts), so the figure is the one a run's `eval_correct` reports, measured again outside the
run: by rollout.generate (greedy, the checkpoint's stop ids, prompts through engine/tokenizer.py) and by
transformers' AutoModelForCausalLM.generate (do_sample=False, one prompt at a time: no padding),
its prompts from AutoTokenizer.apply_chat_template. Both score with the task's own `correct`; the
table counts the rows where the two sides wrote the same text. Weights in the dtype they are stored
in (a bf16 run's model.safetensors is bf16, as the run's sampler was), or --dtype.

    python tests/bench_eval.py --model DIR [--task tasks:chat_add] [--seed 0] [--eval_prompts 64]
        [--max_new_tokens 12] [--threads 2] [--dtype float32]

DIR is a Hugging Face directory: the source checkpoint (accuracy before training) or a run's
step-NNNNNN directory (after). Needs transformers (not a requirement of the engine).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import hf  # noqa: E402
import tasks  # noqa: E402
from engine import tokenizer as tk  # noqa: E402
from rollout import RolloutConfig, generate  # noqa: E402


def stored_dtype(path: str) -> torch.dtype:
    """The dtype model.safetensors holds (the first tensor's)."""
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return f.get_tensor(next(iter(f.keys()))).dtype


@torch.inference_mode()
def engine_texts(path: str, prompts: list, new: int, dtype: torch.dtype) -> list[str]:
    model = hf.load_model(path, dtype=dtype).eval()
    tok = tk.load_tokenizer(path, model.config.vocab_size)
    stop = hf.stop_token_ids(model.config, hf.load_generation_config(path))
    ids = [tok.encode(p, tk.PromptConfig()) for p in prompts]
    out = generate(model, ids, RolloutConfig(num_samples=1, max_new_tokens=new, temperature=0.0),
                   stop_ids=stop)
    return tok.decode_completions(out.completions(), out.stopped.tolist())


@torch.inference_mode()
def transformers_texts(path: str, prompts: list, new: int, dtype: torch.dtype) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(path)
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    texts = []
    for p in prompts:
        ids = tok.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        row = model.generate(ids, do_sample=False, max_new_tokens=new)[0, ids.shape[1]:].tolist()
        texts.append(tok.decode(row[:-1] if row and row[-1] in stop else row))
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--task", default="tasks:chat_add")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_prompts", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="", help="float32 or bfloat16; default: as stored")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    task = tasks.load_task(a.task, "")
    split = tasks.eval_split(task, None, a.eval_prompts, a.seed)
    prompts = [prompt for prompt, _ in split.examples]
    refs = [ref for _, ref in split.examples]
    dtype = getattr(torch, a.dtype) if a.dtype else stored_dtype(a.model)
    rows = {}
    for name, fn in (("engine", engine_texts), ("transformers", transformers_texts)):
        t0 = time.perf_counter()
        rows[name] = fn(a.model, prompts, a.max_new_tokens, dtype)
        right = tasks.count_correct(task, rows[name], refs)
        print(f"{name:>12}: {right}/{len(refs)} correct ({right / len(refs):.1%}), "
              f"{time.perf_counter() - t0:.0f} s")
    same = sum(x == y for x, y in zip(rows["engine"], rows["transformers"]))
    print(f"same text on {same}/{len(refs)} prompts ({a.model}, {dtype}, seed {a.seed}, "
          f"{a.max_new_tokens} new tokens); e.g. {rows['engine'][0]!r} for {refs[0]}")


if __name__ == "__main__":
    main()

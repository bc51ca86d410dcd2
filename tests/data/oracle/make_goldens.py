#!/usr/bin/env python3
"""A second oracle's golden for a model file, on the prompts of an existing
golden file: mainline llama.cpp, as the PyPI package llama-cpp-python builds
it (the same build as make_smollm2_goldens.py, which says how to make it).

  python make_goldens.py MODEL.gguf EXISTING_GOLDEN.jsonl OUT.jsonl

EXISTING_GOLDEN.jsonl is any file in the fixture set's golden format (its
README, "golden/visible"; a file with several models' sections, such as
../shared/cases/moe-divergence.jsonl, gives the section for MODEL): its header and its prompts' names, texts and
prompt_ids are reused, so both oracles start from the very same ids.  The
output has the same format: a header (this oracle, the model's sha256, the
file the prompts came from), then per prompt prompt_ids, the oracle's own
tokenization of the text (oracle_tokenizer_ids, to compare), 32 greedy
tokens, and per step the top-10 logits and the L2 norm of all logits
(teacher forcing on this oracle's own greedy tokens).

How it runs (as the fixture goldens were made): one context, cleared per
prompt, n_threads 1, f16 KV cache, no flash attention, the whole prompt in
one batch (n_batch = n_ubatch = 4096), then 31 single-token steps; raw
logits, ties to the lowest id.
"""
import hashlib
import json
import os
import sys

import llama_cpp
import numpy as np

N_PREDICT = 32
N_CTX = 4096   # the fixture goldens' context; the longest fixture prompt is 2500 tokens


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    model, src, dst = sys.argv[1:4]
    # a file may hold several models' sections (../shared/cases/*.jsonl):
    # the prompts under the header for this model's file name
    head, prompts, cur = None, [], None
    for l in open(src, encoding="utf-8"):
        if not l.strip():
            continue
        j = json.loads(l)
        if j.get("type") == "header":
            cur = j if j.get("model_file") == os.path.basename(model) else None
            head = head or cur
        elif cur is not None and j.get("type") == "prompt":
            prompts.append(j)
    if head is None or not prompts:
        sys.exit(f"{src}: no golden section for {os.path.basename(model)}")
    sha = sha256(model)
    if head.get("model_sha256") not in (None, sha):
        sys.exit(f"{model}: sha256 {sha} is not {src}'s {head['model_sha256']}")
    llm = llama_cpp.Llama(model_path=model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=1,
                          n_threads_batch=1, flash_attn=False, type_k=llama_cpp.GGML_TYPE_F16,
                          type_v=llama_cpp.GGML_TYPE_F16, logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()
    header = {
        "type": "header", "model_file": os.path.basename(model), "model_sha256": sha,
        "prompt_set": head.get("prompt_set"), "prompts_from": os.path.basename(src),
        "oracle": {"repo": "ggml-org/llama.cpp via llama-cpp-python", "version": llama_cpp.__version__,
                   "build": "CPU, GGML_NATIVE=OFF, AVX2/FMA/F16C"},
        "n_threads": 1, "kv_cache_type": "f16", "flash_attn": False, "n_ctx": N_CTX, "n_batch": N_CTX,
        "n_ubatch": N_CTX, "prompt_eval": "whole prompt in one llama_decode call, logits for last position only",
        "n_predict": N_PREDICT, "stop_at_eos": False,
        "sampling": "greedy argmax over raw logits; ties -> lowest token id",
        "tokenize": {"add_special": True, "parse_special": True}, "n_vocab": n_vocab,
        "add_bos": head.get("add_bos"), "bos_id": llm.token_bos(), "eos_id": llm.token_eos(),
        "n_prompts": len(prompts),
    }
    out = open(dst, "w", encoding="utf-8")
    out.write(json.dumps(header) + "\n")
    for p in prompts:
        ids = [int(i) for i in p["prompt_ids"]]
        own = llm.tokenize(p["prompt"].encode("utf-8"), add_bos=bool(head.get("add_bos")), special=True)
        llm.reset()   # n_tokens = 0: eval drops every cached position from 0 on
        llm.eval(ids)
        steps, gen = [], []
        for k in range(N_PREDICT):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
            t = int(np.argmax(logits))          # first maximum: the lowest id on ties
            order = [int(i) for i in np.lexsort((np.arange(n_vocab), -logits))[:10]]   # by logit, then id
            steps.append({"token": t, "piece_hex": llm.detokenize([t], special=True).hex(),
                          "logit_l2": float(np.sqrt(np.sum(logits.astype(np.float64) ** 2))),
                          "top10": [[i, float(logits[i])] for i in order]})
            gen.append(t)
            if k + 1 < N_PREDICT:
                llm.eval([t])
        out.write(json.dumps({"type": "prompt", "index": p["index"], "name": p["name"], "prompt": p["prompt"],
                              "n_prompt_tokens": len(ids), "prompt_ids": ids, "oracle_tokenizer_ids": own,
                              "generated_ids": gen,
                              "generated_text": llm.detokenize(gen, special=True).decode("utf-8", "replace"),
                              "steps": steps}, ensure_ascii=False) + "\n")
        out.flush()
        print(p["name"], len(ids), "prompt tokens", "(own tokenization differs)" if own != ids else "",
              "same greedy tokens as the source" if gen == p.get("generated_ids") else "greedy tokens differ",
              flush=True)
    out.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Goldens for the real SmolLM2-135M-Instruct Q4_1 model from a second oracle:
mainline llama.cpp, as the PyPI package llama-cpp-python builds it from source.

Writes, beside this script:
  smollm2-Q4_1.jsonl          the fixture set's golden format (its README,
                              "golden/visible"): a header line, then per prompt
                              prompt_ids, 32 greedy tokens, and per step the
                              top-10 logits and the L2 norm of all logits
                              (teacher forcing on the oracle's own tokens)
  smollm2-tokenize.jsonl      {"text", "ids"} for strings that exercise the
                              smollm pre-tokenizer (digits, spaces, contractions,
                              Unicode, special tokens), add_special and
                              parse_special on

Run outside CI (building llama-cpp-python takes many minutes):
  python3 -m venv build/oracle-venv
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
      build/oracle-venv/bin/pip install llama-cpp-python==0.3.36 numpy==<any 2.x>
  tools/models.sh
  build/oracle-venv/bin/python tests/data/oracle/make_smollm2_goldens.py \
      build/models/real/SmolLM2-135M-Instruct.Q4_1.gguf
(A shortcut while pip's build is still compiling its multimodal library:
libllama.so is already in its build folder's bin/; copying the package's
llama_cpp/ sources with those libraries in llama_cpp/lib/ and setting
PYTHONPATH runs this script the same way: how the committed files were made.)
How it runs (as the fixture goldens were made): one context, cleared per
prompt, n_threads 1, f16 KV cache, no flash attention, the whole prompt in
one batch, then 31 single-token steps; raw logits, ties to the lowest id.
"""
import hashlib
import json
import os
import sys

import llama_cpp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
N_PREDICT = 32

CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
        "<|im_start|>assistant\n")
PROMPTS = [
    ("00_short_english", "The quick brown fox jumps over the lazy dog. Then it runs back home to"),
    ("01_chatml", CHAT),
    ("02_code_digits", "def area(r):\n    return 3.14159 * r ** 2\n\n# area(10) is 314.159, and in 2024 we"),
    ("03_feedback", "<|im_start|>user\nGive one sentence of feedback on this code: for i in range(10): print(i)<|im_end|>\n"
                    "<|im_start|>assistant\n"),
]
TOKENIZE = [
    "Hello world", " Hello world", "Hello  world", "a  5", "x 12345 y", "1,000,000.50",
    "in 2024 they'd've said I'm OK", "I'LL DO IT", "tabs\tand\nnewlines\n\n  end  ",
    "naïve café – 東京 🙂 ½ Ⅻ ٣", "<|im_start|>user\nhi<|im_end|>", "   ", "3rd 4th 10x", "",
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def main():
    model = sys.argv[1]
    llm = llama_cpp.Llama(model_path=model, n_ctx=4096, n_batch=4096, n_ubatch=4096, n_threads=1,
                          n_threads_batch=1, flash_attn=False, type_k=llama_cpp.GGML_TYPE_F16,
                          type_v=llama_cpp.GGML_TYPE_F16, logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()
    tok = lambda s: llm.tokenize(s.encode("utf-8"), add_bos=True, special=True)
    with open(os.path.join(HERE, "smollm2-tokenize.jsonl"), "w") as f:
        for s in TOKENIZE:
            f.write(json.dumps({"text": s, "ids": tok(s)}, ensure_ascii=False) + "\n")
    out = open(os.path.join(HERE, "smollm2-Q4_1.jsonl"), "w")
    header = {
        "type": "header", "model_file": os.path.basename(model), "model_sha256": sha256(model),
        "oracle": {"repo": "ggml-org/llama.cpp via llama-cpp-python", "version": llama_cpp.__version__,
                   "build": "CPU, GGML_NATIVE=OFF, AVX2/FMA/F16C"},
        "n_threads": 1, "kv_cache_type": "f16", "flash_attn": False, "n_ctx": 4096, "n_batch": 4096,
        "n_predict": N_PREDICT, "stop_at_eos": False,
        "sampling": "greedy argmax over raw logits; ties -> lowest token id",
        "tokenize": {"add_special": True, "parse_special": True}, "n_vocab": n_vocab,
        "add_bos": False, "bos_id": llm.token_bos(), "eos_id": llm.token_eos(), "n_prompts": len(PROMPTS),
    }
    out.write(json.dumps(header) + "\n")
    for idx, (name, text) in enumerate(PROMPTS):
        llm.reset()   # n_tokens = 0: eval drops every cached position from 0 on
        ids = tok(text)
        llm.eval(ids)
        steps, gen = [], []
        for k in range(N_PREDICT):
            # the last position's logits (llama-cpp-python keeps no scores
            # without logits_all, which would compute every position's)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
            t = int(np.argmax(logits))          # first maximum: the lowest id on ties
            order = [int(i) for i in np.lexsort((np.arange(n_vocab), -logits))[:10]]   # by logit, then id
            steps.append({"token": t, "piece_hex": llm.detokenize([t], special=True).hex(),
                          "logit_l2": float(np.sqrt(np.sum(logits.astype(np.float64) ** 2))),
                          "top10": [[i, float(logits[i])] for i in order]})
            gen.append(t)
            if k + 1 < N_PREDICT:
                llm.eval([t])
        out.write(json.dumps({"type": "prompt", "index": idx, "name": name, "prompt": text,
                              "n_prompt_tokens": len(ids), "prompt_ids": ids, "generated_ids": gen,
                              "generated_text": llm.detokenize(gen, special=True).decode("utf-8", "replace"),
                              "steps": steps}, ensure_ascii=False) + "\n")
        print(name, len(ids), "prompt tokens:", repr(llm.detokenize(gen).decode("utf-8", "replace")))
    out.close()


if __name__ == "__main__":
    main()

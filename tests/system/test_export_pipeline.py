"""`dtrain export`'s folder as transformers consumes it in a clean interpreter: the text-generation
pipeline with the Hub off and an empty cache (HF_HUB_OFFLINE is read at import, so the pipeline runs in
a process of its own; tests/unit/test_export.py checks the export itself in-process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer.tokenizers import gpt2
from trainer.tokenizers.gpt2 import EOT, encode


def test_text_generation_pipeline_runs_offline(trained, hf_folder, tmp_path):
    """transformers' pipeline on the folder with the Hub off and an empty HF cache (nothing to fall
    back on) generates the tokens dtrain's model picks greedily."""
    pytest.importorskip("transformers")
    _, live = trained
    prompt = "ROMEO: What light"
    idx = torch.tensor([encode(prompt)])
    with torch.no_grad():
        for _ in range(8):
            nxt = live(idx)[0][0, -1].argmax()
            if nxt == EOT:
                break
            idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    script = textwrap.dedent("""
        import json, sys
        import transformers
        generate = transformers.pipeline("text-generation", model=sys.argv[1])
        out = generate(sys.argv[2], max_new_tokens=8, do_sample=False)
        print(json.dumps(out[0]["generated_text"]))
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = subprocess.run([sys.executable, "-c", script, str(hf_folder), prompt], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = json.loads(proc.stdout.strip().splitlines()[-1])
    assert text == gpt2.decode(idx[0].tolist()) and len(idx[0]) > len(encode(prompt))

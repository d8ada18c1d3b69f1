"""A random-weight HF directory of the default model's shape (SmolLM2-135M), with its tokenizer and no end-of-
sequence id (a random model's greedy tokens must not stop the answer early)."""
import shutil, sys
import torch
from tandem.shapes import build_random_model
out, tok = sys.argv[1], sys.argv[2]
model = build_random_model("smollm2-135m", "cpu", torch.bfloat16)
model.config.eos_token_id = None
if model.generation_config is not None:
    model.generation_config.eos_token_id = None
model.save_pretrained(out)
for f in __import__("os").listdir(tok):
    shutil.copy(f"{tok}/{f}", out)
words = ("the quick brown fox jumps over the lazy dog while a river runs past old stone walls and "
         "children count the boats that drift toward the harbour at dusk ").split()
text = " ".join(words[i % len(words)] + (str(i) if i % 7 == 0 else "") for i in range(1900))
open(f"{out}/prompt.txt", "w").write(text)
print("saved", out)

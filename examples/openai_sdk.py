"""A script written for OpenAI's fine-tuning API, run against megatrain: only the client line changes.

Run it against the embedded stack `megatrain demo` started, after examples/README.md's steps 2-3
(the demo model exported and registered as demo-llama), with `pip install openai`:

    python examples/openai_sdk.py

It uploads examples/data/chat.jsonl, fine-tunes demo-llama on it (LoRA, 3 epochs: a few minutes on
a CPU), waits for the job, then asks the fine-tuned model a question through chat completions,
streamed (the first request starts the model server: seconds).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from openai import OpenAI

HERE = Path(__file__).resolve().parent

# The one change: where the API is and its key (the embedded default writes it here).
key = os.environ.get("MEGATRAIN_API_KEY") or (Path.home() / ".megatrain" / "credentials").read_text().strip()
client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/openai/v1"), api_key=key)

# Everything below is OpenAI's own fine-tuning quickstart.
with open(HERE / "data" / "chat.jsonl", "rb") as f:
    training_file = client.files.create(file=f, purpose="fine-tune")
job = client.fine_tuning.jobs.create(
    model="demo-llama",
    training_file=training_file.id,
    suffix="colours",
    # The demo's 1.2M-parameter model wants a far higher rate than a real LLM's LoRA (1e-4 × the
    # multiplier): 3 epochs of 50 steps at 5e-3, as examples/finetune_lora.yaml trains it.
    method={
        "type": "supervised",
        "supervised": {"hyperparameters": {"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 50}},
    },
)
print(f"fine-tuning job {job.id}: {job.status}")
while job.status not in ("succeeded", "failed", "cancelled"):
    time.sleep(5)
    job = client.fine_tuning.jobs.retrieve(job.id)
    events = client.fine_tuning.jobs.list_events(job.id, limit=1).data
    print(f"  {job.status}: {events[0].message if events else ''}")
if job.status != "succeeded":
    raise SystemExit(f"the job ended {job.status}: {job.error}")

print(f"fine-tuned model: {job.fine_tuned_model}")
stream = client.chat.completions.create(
    model=job.fine_tuned_model,
    messages=[{"role": "user", "content": "Reverse the word lemon."}],
    max_tokens=16,
    temperature=0,
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()

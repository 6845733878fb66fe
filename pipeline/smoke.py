"""A greedy answer to one chat prompt after prepare and after quantize: a cheap check that the weights
still make sense (a private helper of those two stages)."""

from __future__ import annotations


def smoke_generate(model, tokenizer, prompt: str = "What is the capital of France?", max_new_tokens: int = 12) -> str:
    """Greedy answer to one chat prompt: a cheap check that the weights still make sense."""
    import torch

    messages = [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    ids = ids.to(model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()

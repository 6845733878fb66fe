"""A tiny Llama (random weights) and a word-level tokenizer, built in the test: seconds, no downloads."""

from pathlib import Path

WORDS = [
    "<unk>",
    "<s>",
    "</s>",
    "the",
    "capital",
    "of",
    "is",
    "what",
    "paris",
    "france",
    "python",
    "module",
    "explain",
    "this",
    "part",
    "a",
    "and",
    "to",
    "in",
    "for",
]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return fast


def tiny_llama_dir(path: Path, hidden: int = 64, intermediate: int = 128, seed: int = 0) -> Path:
    """Save a 2-layer Llama (GQA, tied embeddings) with a tokenizer and build.json to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantgate.manifest import write_manifest

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    write_manifest(
        path,
        build="fp16",
        scheme="BF16",
        dtype="bfloat16",
        base_model={"id": "tiny-llama", "sha256": "0" * 64},
        recipe={"source": "test"},
    )
    return path

"""Build the tiny random-weight Llama and its tokenizer that the real-engine tests serve.

Run with the real-engine venv's Python (it needs torch, transformers and tokenizers):
`python scripts/tiny_model.py DIR`. Nothing is downloaded: the weights are random (seeded, so
every build is the same model) and the tokenizer is trained on the standard library's own
source files. What the tests need is the engine, its scheduler, its metrics and its speculation
counters, not good text; at temperature 0 the model falls into loops, which ngram speculation
guesses well.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 2048
CONTEXT = 2048
SPECIAL = ["<unk>", "<s>", "</s>"]
# A minimal chat template: role-tagged turns, then the assistant's turn when asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def training_text(limit_bytes: int = 8_000_000) -> list[str]:
    """Source files of the standard library, in a fixed order, up to `limit_bytes`."""
    texts: list[str] = []
    size = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size > limit_bytes:
            break
    return texts


def build_tokenizer(directory: Path) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=CONTEXT,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(directory)


def build_model(directory: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(directory)


def main() -> None:
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    build_model(directory)


if __name__ == "__main__":
    main()

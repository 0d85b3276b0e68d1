"""A random-weight vision-language model of SmolVLM-256M's shapes, for speed and memory figures (not for
answers): the text GGUF and the mmproj GGUF, both made by llama.cpp's own converter.

No real SmolVLM can be had from the package registries this project may use (docs/benchmarks.md,
"Vision"), so the vision benchmarks run on this: SmolVLM-256M's published shapes (text: a llama of width
576, 30 layers, 9 query / 3 KV heads, FFN 1536, vocab 49280; vision: SigLIP-B/16 at 512 pixels, width 768,
12 layers, 12 heads, MLP 3072; pixel shuffle 4: 64 tokens a tile) with N(0, 0.02²) weights. The tokenizer
is a small byte-level BPE with SmolVLM's image specials, padded by the converter to the vocab. Needs torch
and transformers (the tiny-vlm oracle's venv, tests/fixtures/tiny-vlm/README.md):

    /tmp/oracle/bin/python tools/make_sized_smolvlm.py --llamacpp $LLAMACPP --out /tmp/smolvlm-sized \
        [--longest-edge 512] [--outtype f16]

`--longest-edge` is the processor's `size.longest_edge` written into the mmproj: SmolVLM-256M ships 2048
(an image becomes up to 4 x 4 tiles + the whole image, 17 encoder passes); 512 makes every image one tile,
which is what a 2-core CPU can benchmark at 8 streams.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>",
            "<image>", "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
TEMPLATE = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<image>' }}"
            "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llamacpp", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--longest-edge", type=int, default=512)
    ap.add_argument("--outtype", default="f16")
    args = ap.parse_args()
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = Path(tempfile.mkdtemp(prefix="smolvlm-sized-"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # "\n" and "\n\n" must be tokens of their own, as in SmolVLM's vocabulary: llama.cpp's Idefics3 prompt
    # looks both up as single tokens
    corpus = ("What is in this image? Describe the colours, the shapes and the light. User: Assistant: " * 50
              + "\n\n ".join(["A line.\n Another line.\n The end."] * 40))
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIALS,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(hf / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": TEMPLATE}))
    text = dict(model_type="llama", vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<end_of_utterance>"],
                pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True)
    vision = dict(model_type="idefics3_vision", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, image_size=512, patch_size=16, layer_norm_eps=1e-6,
                  hidden_act="gelu_pytorch_tanh")
    cfg = Idefics3Config(text_config=text, vision_config=vision, scale_factor=4, image_token_id=ids["<image>"],
                         tie_word_embeddings=True, pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(256)
    model = Idefics3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(hf, safe_serialization=True)
    conf = json.loads((hf / "config.json").read_text())
    conf["text_config"]["architectures"] = ["VLlama3ForCausalLM"]  # as the published SmolVLM checkpoints
    (hf / "config.json").write_text(json.dumps(conf, indent=1))
    Idefics3ImageProcessorPil(size={"longest_edge": args.longest_edge}, max_image_size={"longest_edge": 512},
                              image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(hf)
    conv = Path(args.llamacpp) / "convert_hf_to_gguf.py"
    wrapper = hf / "convert.py"
    wrapper.write_text(
        "import sys, runpy\n"
        f"sys.path.insert(0, {str(Path(args.llamacpp) / 'gguf-py')!r}); sys.path.insert(0, {str(Path(args.llamacpp))!r})\n"
        "import conversion.base as b\n"
        "for cls in [getattr(b, n) for n in dir(b)]:\n"
        "    if isinstance(cls, type) and hasattr(cls, 'get_vocab_base_pre'):\n"
        "        cls.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        f"sys.argv = [{str(conv)!r}] + sys.argv[1:]\n"
        f"runpy.run_path({str(conv)!r}, run_name='__main__')\n")
    for extra, name in (([], "smolvlm-sized.gguf"), (["--mmproj"], "smolvlm-sized.mmproj.gguf")):
        subprocess.run([sys.executable, str(wrapper), str(hf), "--outtype", args.outtype, "--outfile",
                        str(out / name)] + extra, check=True)
    print("wrote", out, "from", hf)


if __name__ == "__main__":
    main()

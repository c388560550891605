"""Save an HF (safetensors) copy of a GGUF model, for peers that read only HF directories
(vLLM's CPU build in ``benchmarks/peers.py``).

transformers dequantizes the GGUF on load; its ``save_pretrained`` refuses a model loaded from
a GGUF, so the state dict, config, generation config and tokenizer are saved one by one. The
copy is checked: it reloads and gives the same logits as the GGUF. Usage:

    python benchmarks/hf_copy.py [--gguf FILE] [--dtype bfloat16] [--out /tmp/smollm2-hf]

(the default GGUF is the embedded SmolLM2-135M-Instruct Q4_1; bfloat16 is the dtype vLLM's CPU
build runs.)
"""

from __future__ import annotations

import argparse
import os


def main(args: argparse.Namespace) -> int:
    import safetensors.torch
    import torch
    import transformers

    from asyncengine.executor.weights.loader import embedded_model_path

    directory, name = os.path.split(args.gguf or embedded_model_path())
    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                              dtype=dtype)
    os.makedirs(args.out, exist_ok=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    safetensors.torch.save_file(state, os.path.join(args.out, "model.safetensors"),
                                metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights are saved dequantized
        del config.quantization_config
    config.save_pretrained(args.out)
    model.generation_config.save_pretrained(args.out)
    transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(args.out)
    copy = transformers.AutoModelForCausalLM.from_pretrained(args.out, dtype=dtype)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        same = torch.equal(copy(ids).logits, model(ids).logits)
    print(f"saved {args.out} ({sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters, "
          f"{args.dtype}); same logits as the GGUF: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="/tmp/smollm2-hf")
    raise SystemExit(main(parser.parse_args()))

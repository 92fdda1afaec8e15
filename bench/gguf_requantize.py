"""Write a copy of a GGUF file whose linear layers' weights are in another block type (Q8_0,
Q4_0 or Q4_1), as llama.cpp's quantize tool would from the file's own values: every linear
weight is dequantized and quantized again by the gguf package; the embeddings, norms, the
LM head and all metadata (tokenizer and chat template included) are copied as they are.

For the quality bench and the tests: the embedded SmolLM2 ships as Q4_1 only, and a Q8_0
copy of it is how its W8A16 path runs on a real model here (no model hub).

    python3 bench/gguf_requantize.py smollm2-135m-instruct /tmp/smollm2-q8_0.gguf [--type Q8_0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill.engine.loader.gguf_file import open_gguf  # noqa: E402
from tokenmill.engine.loader.model_source import resolve_model_source  # noqa: E402

_LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # general.file_type (llama.cpp's LLAMA_FTYPE)


def is_linear(tensor_name: str) -> bool:
    """``blk.N.<part>.weight`` of a linear layer."""
    parts = tensor_name.split(".")
    return (
        len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR_PARTS and parts[3] == "weight"
    )


def requantize(model: str, out: Path, linear_type: str = "Q8_0") -> Path:
    """Write ``model`` (an alias or .gguf path) to ``out`` with its linear weights in
    ``linear_type``. Returns ``out``."""
    kind = gguf.GGMLQuantizationType[linear_type]
    reader = open_gguf(resolve_model_source(model).path)
    arch = str(reader.get_field("general.architecture").contents())
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        value = _FILE_TYPES[linear_type] if name == "general.file_type" else field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type)
    for tensor in reader.tensors:
        if is_linear(tensor.name):
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            writer.add_tensor(tensor.name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="an alias or a .gguf file")
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="Q8_0", choices=sorted(_FILE_TYPES))
    args = ap.parse_args()
    print(requantize(args.model, args.out, args.type))


if __name__ == "__main__":
    main()

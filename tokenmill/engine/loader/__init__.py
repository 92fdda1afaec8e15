"""Model loading: resolve a model name or path, then read its config, weights and tokenizer.

source = resolve_model_source("smollm2-135m-instruct")   # or an HF dir, or a .gguf file
config = source.load_config()                            # ModelConfig
model.load_weights(source.iter_weights())                # (HF name, tensor), one at a time
tokenizer = source.load_tokenizer()                      # with chat_template when shipped
"""

from __future__ import annotations

from tokenmill.engine.loader.model_source import MODEL_ALIASES, ModelSource, resolve_model_source

__all__ = ["MODEL_ALIASES", "ModelSource", "resolve_model_source"]

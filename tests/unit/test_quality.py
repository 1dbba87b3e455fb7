"""The default model's default weight format against its float32 reference (issue 11).

The speed benchmark prints the same figures (``python -m bench.quality``);
this test holds the thresholds: perplexity within 2 % of the float32
rendition of the GGUF weights, and greedy answers at least as close to it as
bfloat16's.
"""

from __future__ import annotations

from pathlib import Path

from bench.quality import PPL_TOLERANCE, measure_quality, quality_table
from config import Catalog
from models.loader import load_model


def test_int4_keeps_perplexity_and_greedy_answers_of_the_reference(
    catalog: Catalog, model_cache_dir: Path
) -> None:
    definition = catalog["smollm2-135m"].model_copy(
        update={"dtype": "float32", "quantization": "none", "device": "cpu"}
    )
    loaded = load_model(definition, catalog, model_cache_dir, keep_weights=True)
    reference, bf16, int4 = measure_quality(loaded.model, loaded.tokenizer)
    table = quality_table([reference, bf16, int4])
    assert abs(int4.ppl_change) <= PPL_TOLERANCE, table
    assert int4.agreement >= bf16.agreement, table
    assert int4.agreement > 0.5, table  # and the answers are mostly the reference's

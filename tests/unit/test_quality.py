"""The default model's weight formats against its float32 reference (issue 11).

The speed benchmark prints the same figures (``python -m bench.quality``);
this test holds the thresholds: perplexity within 2 % of the float32
rendition of the GGUF weights, and greedy answers at least as close to it as
bfloat16's for the default int4; perplexity within 2 % for the int4-a8 choice.
"""

from __future__ import annotations

from pathlib import Path

from bench.quality import PPL_TOLERANCE, bench_formats, measure_quality, quality_table
from config import Catalog
from models.loader import load_model


def test_int4_keeps_perplexity_and_greedy_answers_of_the_reference(
    catalog: Catalog, model_cache_dir: Path
) -> None:
    definition = catalog["smollm2-135m"].model_copy(
        update={"dtype": "float32", "quantization": "none", "device": "cpu"}
    )
    loaded = load_model(definition, catalog, model_cache_dir, keep_weights=True)
    rows = measure_quality(loaded.model, loaded.tokenizer, bench_formats())
    bf16, int4 = rows[1:3]
    table = quality_table(rows)
    assert abs(int4.ppl_change) <= PPL_TOLERANCE, table
    assert int4.agreement >= bf16.agreement, table
    assert int4.agreement > 0.5, table  # and the answers are mostly the reference's
    if len(rows) > 3:  # the int4-a8 choice, where the kernels have panels
        a8 = rows[3]
        assert abs(a8.ppl_change) <= PPL_TOLERANCE, table
        # It drifts further than int4 (why it is not the default), and still
        # begins most answers as the reference does.
        assert int4.agreement > a8.agreement > 0.3, table

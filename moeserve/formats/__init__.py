"""Quantized weight formats as pure functions, the `Format` interface over them, and config parsing.

See docs/formats.md. Typical use: ``scheme = load_quant_scheme(model_dir)``, then per weight
``fmt = scheme.format_for(prefix)``, ``tensors = fmt.select(prefix, state)``, ``fmt.dequantize(tensors, out)``.
"""

from moeserve.formats.base import Format
from moeserve.formats.catalog import FORMATS, create_format
from moeserve.formats.quant_config import QuantScheme, load_quant_scheme, parse_quant_config

__all__ = ["FORMATS", "Format", "QuantScheme", "create_format", "load_quant_scheme", "parse_quant_config"]

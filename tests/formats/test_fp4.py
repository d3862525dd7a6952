import numpy as np
import pytest
import torch

from moeserve.formats.fp4 import E2M1_VALUES, e2m1_byte_table, unpack_fp4
from tests.formats.numpy_decoders import decode_e2m1, unpack_nibbles


def test_e2m1_values_match_bit_definition():
    expected = decode_e2m1(np.arange(16))
    assert np.array_equal(np.array(E2M1_VALUES), expected)
    assert np.array_equal(np.signbit(np.array(E2M1_VALUES)), np.signbit(expected))  # -0.0 at code 8


def test_byte_table_low_nibble_is_even_element():
    table = e2m1_byte_table(torch.float32, torch.device("cpu"))
    assert table.shape == (256, 2)
    assert table[0x71].tolist() == [0.5, 6.0]  # low nibble 1 -> 0.5, high nibble 7 -> 6.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpack_matches_numpy(dtype):
    packed = torch.randint(0, 256, (7, 33), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = torch.empty(7, 66, dtype=dtype)
    unpack_fp4(packed, out)
    expected = decode_e2m1(unpack_nibbles(packed.numpy()))
    assert torch.equal(out.float(), torch.from_numpy(expected).float())


def test_unpack_rejects_wrong_output_size():
    with pytest.raises(ValueError, match="elements"):
        unpack_fp4(torch.zeros(4, dtype=torch.uint8), torch.empty(7))

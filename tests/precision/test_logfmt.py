"""LogFMT-n: the codec's rounding against brute force, its bit layout, edge cases, and the study command."""

import json
import math

import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.precision import logfmt

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def random_tiles(n_tiles: int, seed: int) -> torch.Tensor:
    """float32 [n_tiles, 128]: Gaussian tiles of random scale, and log-uniform tiles spanning up to 2^-50
    (so the 2^-32 clamp is active and some values fall between 0 and the min level); sprinkled zeros."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 10, (n_tiles, 1), generator=g).float())
    gaussian = torch.randn(n_tiles, 128, generator=g) * scale
    span = torch.rand(n_tiles, 1, generator=g) * 50
    log_uniform = torch.exp2(-torch.rand(n_tiles, 128, generator=g) * span) * scale
    log_uniform *= torch.randn(n_tiles, 128, generator=g).sign()
    x = torch.where(torch.arange(n_tiles).unsqueeze(1) % 2 == 0, gaussian, log_uniform)
    x[torch.rand(n_tiles, 128, generator=g) < 0.05] = 0
    return x


def reference_levels(tile: torch.Tensor, bits: int) -> torch.Tensor:
    """Every representable magnitude of one tile, straight from the definition, float64 [2^(bits-1)]."""
    magnitude = tile.double().abs()
    nonzero = magnitude[magnitude > 0]
    log_max = math.log2(nonzero.max().item())
    log_min = max(math.log2(nonzero.min().item()), log_max - 32)
    step = (log_max - log_min) / (2 ** (bits - 1) - 2)
    k = torch.arange(1, 2 ** (bits - 1), dtype=torch.float64)
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.exp2((k - 1) * step + log_min)])


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Equal up to float64 rounding (1e-12 relative): exact equality for every narrower dtype."""
    return (a.double() - b.double()).abs() <= 1e-12 * b.double().abs()


def assert_nearest(x: torch.Tensor, q: torch.Tensor, bits: int) -> None:
    """Each |q| is the level nearest |x| in linear space (either one on a tie within 1e-9 relative)."""
    for tile, got in zip(x, q, strict=True):
        if not tile.any():
            assert not got.any()
            continue
        levels = reference_levels(tile, bits)
        distance = (tile.double().abs().unsqueeze(1) - levels).abs()  # [128, levels]
        best2 = distance.topk(2, largest=False)
        expected = levels[best2.indices[:, 0]].to(x.dtype)
        runner_up = levels[best2.indices[:, 1]].to(x.dtype)
        tie = best2.values[:, 1] - best2.values[:, 0] <= 1e-9 * tile.double().abs()
        ok = same(got.abs(), expected) | (tie & same(got.abs(), runner_up))
        assert ok.all(), f"{(~ok).sum()} elements not nearest, e.g. x={tile[~ok][:3]} q={got[~ok][:3]}"


@pytest.mark.parametrize("bits", [4, 5, 8, 10, 13])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_every_element_rounds_to_the_nearest_level_in_linear_space(bits, dtype):
    x = random_tiles(24, seed=bits).to(dtype)
    assert_nearest(x, logfmt.quantize(x, bits), bits)


def test_sixteen_bits_round_to_the_nearest_level_too():
    x = random_tiles(4, seed=16)
    assert_nearest(x, logfmt.quantize(x, 16), 16)


def test_log_space_rounding_is_a_different_rule():
    """The comparison variant really rounds in log space: nearest level by |log2 x - log2 level|."""
    x = random_tiles(8, seed=3)[::2]  # Gaussian tiles: no clamp, every non-zero at or above the min level
    q = logfmt.quantize(x, 6, rounding="log")
    for tile, got in zip(x, q, strict=True):
        levels = reference_levels(tile, 6)[1:]
        nonzero = tile != 0
        log_distance = (tile[nonzero].double().abs().log2().unsqueeze(1) - levels.log2()).abs()
        assert torch.equal(got[nonzero].abs().double(), levels[log_distance.argmin(1)].float().double())
    assert not torch.equal(q, logfmt.quantize(x, 6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_and_signs_survive(dtype):
    x = random_tiles(16, seed=1).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])  # the tiny ones round to signed zeros
    q = logfmt.quantize(x, 8)
    assert torch.equal(torch.signbit(q), torch.signbit(x))
    assert (q[x == 0] == 0).all()
    assert q[0, 2].item() == 0 and torch.signbit(q[0, 3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8, 10, 16])
def test_tile_max_and_unclamped_min_are_exact(dtype, bits):
    x = (torch.randn(6, 256, generator=torch.Generator().manual_seed(bits)) * 0.05).to(dtype)
    q = logfmt.quantize(x, bits)
    tiles, qtiles = x.view(12, 128), q.view(12, 128)
    at_max = tiles.abs().argmax(1, keepdim=True)
    assert torch.equal(qtiles.gather(1, at_max), tiles.gather(1, at_max))
    at_min = tiles.abs().argmin(1, keepdim=True)  # Gaussian tiles span far less than 2^32: no clamp
    assert torch.equal(qtiles.gather(1, at_min), tiles.gather(1, at_min))


@pytest.mark.parametrize("bits", range(4, 17))
@pytest.mark.parametrize("shape", [(3, 130), (7,), (2, 3, 256), (5, 1), ()])
def test_decode_of_encode_is_quantize_bit_for_bit_and_the_payload_is_exact(bits, shape):
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(bits)) * 0.3).to(dtype)
        packed = logfmt.encode(x, bits)
        decoded = logfmt.decode(packed)
        q = logfmt.quantize(x, bits)
        assert decoded.dtype == dtype and decoded.shape == x.shape
        assert torch.equal(decoded, q) and torch.equal(torch.signbit(decoded), torch.signbit(q))
        assert packed.payload.dtype == torch.uint8
        assert packed.payload_bytes == math.ceil(x.numel() * bits / 8)
        n_tiles = (x.numel() // (shape[-1] if shape else 1)) * math.ceil((shape[-1] if shape else 1) / 128)
        assert packed.metadata_bytes == n_tiles * 2 * x.element_size()


def test_deepep_byte_count_for_a_7168_wide_bf16_token():
    """DeepEP's LogFMT-10 (docs/references.md): hidden*10/8 + hidden/128*4 = 9,184 bytes for one 7168-wide
    token."""
    packed = logfmt.encode(torch.randn(1, 7168).to(torch.bfloat16), 10)
    assert (packed.payload_bytes, packed.metadata_bytes, packed.nbytes) == (8960, 224, 9184)


@pytest.mark.parametrize("bits", [5, 10, 11, 13])
def test_payload_layout_is_little_endian_words_with_the_sign_on_top(bits):
    """Word i sits at bit i*bits of the payload read as one little-endian integer; padding bits are 0."""
    x = random_tiles(2, seed=bits)[:, :37]  # 74 elements: numel * bits not a multiple of 8 for odd bits
    packed = logfmt.encode(x, bits)
    stream = int.from_bytes(packed.payload.numpy().tobytes(), "little")
    words = [(stream >> (i * bits)) & ((1 << bits) - 1) for i in range(x.numel())]
    assert stream >> (x.numel() * bits) == 0
    codes = torch.tensor([w & ((1 << (bits - 1)) - 1) for w in words]).view(x.shape)
    signs = torch.tensor([w >> (bits - 1) for w in words], dtype=torch.bool).view(x.shape)
    assert torch.equal(signs, torch.signbit(x))
    q = logfmt.quantize(x, bits)
    assert torch.equal(codes == 0, q == 0)
    top = 2 ** (bits - 1) - 1
    assert (codes.gather(1, x.abs().argmax(1, keepdim=True)) == top).all()
    for row in range(2):  # the decode formula, applied by hand to the codes, gives the quantized values
        levels = reference_levels(x[row], bits)
        assert torch.allclose(levels[codes[row]].float(), q[row].abs(), rtol=1e-6, atol=0)


def test_all_zero_tile_one_non_zero_and_min_equal_max():
    x = torch.zeros(4, 128)
    x[0, 1] = -0.0
    x[1, 5] = -3.25  # one non-zero
    x[2] = 0.75 * torch.tensor([1.0, -1.0]).repeat(64)  # min == max
    x[3, ::3] = 1e-3
    for bits in (4, 8, 16):
        q = logfmt.quantize(x, bits)
        assert torch.equal(q, x) and torch.equal(torch.signbit(q), torch.signbit(x))
        packed = logfmt.encode(x, bits)
        assert torch.equal(packed.meta[0, 0], torch.zeros(2))
        assert torch.equal(packed.meta[:, 0, 0], torch.tensor([0.0, 3.25, 0.75, 1e-3]))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_and_nan_are_refused(bad, dtype):
    x = torch.randn(2, 200).to(dtype)
    x[1, 150] = bad
    with pytest.raises(DSV3Error, match="inf or nan"):
        logfmt.quantize(x, 8)
    with pytest.raises(DSV3Error, match="inf or nan"):
        logfmt.encode(x, 10)


def test_a_partial_last_tile_is_its_own_tile():
    x = random_tiles(3, seed=7).view(1, 384)[:, :300].clone()
    pieces = [logfmt.quantize(x[:, a:b].clone(), 8) for a, b in ((0, 128), (128, 256), (256, 300))]
    assert torch.equal(logfmt.quantize(x, 8), torch.cat(pieces, 1))
    assert torch.equal(logfmt.decode(logfmt.encode(x, 8)), torch.cat(pieces, 1))


def test_strided_views_encode_like_their_contiguous_copies():
    big = torch.randn(40, 400, generator=torch.Generator().manual_seed(5))
    for view in (big[:, 10:300], big.t(), big[::2, ::3]):
        expected = logfmt.quantize(view.contiguous(), 10)
        assert torch.equal(logfmt.quantize(view, 10), expected)
        assert torch.equal(logfmt.decode(logfmt.encode(view, 10)), expected)


def test_input_is_not_modified_and_empty_tensors_work():
    x = torch.randn(3, 200, dtype=torch.float64)
    before = x.clone()
    logfmt.quantize(x, 8), logfmt.encode(x, 8)
    assert torch.equal(x, before)
    for shape in [(0,), (3, 0), (0, 128)]:
        empty = torch.zeros(shape)
        assert logfmt.quantize(empty, 8).shape == shape
        packed = logfmt.encode(empty, 8)
        assert packed.nbytes == 0 and logfmt.decode(packed).shape == shape


@pytest.mark.parametrize("bits", [3, 17, 8.0, True, "8"])
def test_bad_bits_dtype_and_rounding_are_refused(bits):
    with pytest.raises(DSV3Error, match="bits"):
        logfmt.quantize(torch.randn(4), bits)
    with pytest.raises(DSV3Error, match="bfloat16, float16, float32 or float64"):
        logfmt.encode(torch.arange(4), 8)
    with pytest.raises(DSV3Error, match="rounding"):
        logfmt.quantize(torch.randn(4), 8, rounding="stochastic")


def test_a_truncated_payload_is_refused():
    packed = logfmt.encode(torch.randn(2, 128), 10)
    broken = logfmt.LogFMTPacked(packed.payload[:-1], packed.meta, packed.shape, packed.dtype, 10)
    with pytest.raises(DSV3Error, match="payload"):
        logfmt.decode(broken)


def test_bf16_fallback_follows_deepeps_rule():
    """Tiles with amax >= 1 (or one magnitude only) go as BF16; the rest as LogFMT; decode still exact."""
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.1
    x[0, :128] *= 100  # amax >= 1
    x[1, 128:256] = 0.5  # one magnitude
    q = logfmt.quantize(x, 8, fallback=True)
    plain = logfmt.quantize(x, 8)
    as_bf16 = x.to(torch.bfloat16).double()
    assert torch.equal(q[0, :128], as_bf16[0, :128]) and torch.equal(q[1, 128:256], as_bf16[1, 128:256])
    assert torch.equal(q[0, 128:], plain[0, 128:]) and not torch.equal(q[0, :128], plain[0, :128])
    packed = logfmt.encode(x, 8, fallback=True)
    assert torch.equal(logfmt.decode(packed), q)
    assert packed.fallback_bytes == 2 * 2 * 128 and packed.metadata_bytes == 8 * 16 + 1


def test_error_is_unbiased_on_symmetric_data_and_less_biased_than_log_space_rounding():
    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(64, 4096, generator=g)
    error = (logfmt.quantize(gaussian, 8).double() - gaussian.double()).mean() / gaussian.abs().mean()
    assert abs(error.item()) < 2e-4  # standard error of this mean is about 3e-5
    # Flat density between adjacent levels, where linear rounding is exactly unbiased: a jittered grid of
    # 2^18 magnitudes in (0, 1] (stratified, so the mean has little noise), shuffled into tiles, signs mixed.
    n = 1 << 18
    grid = (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=g, dtype=torch.float64)) / n
    uniform = grid[torch.randperm(n, generator=g)].view(-1, 128) * torch.tensor([1.0, -1.0]).repeat(64)

    def magnitude_bias(q):
        return ((q.abs() - uniform.abs()).mean() / uniform.abs().mean()).item()

    linear = magnitude_bias(logfmt.quantize(uniform, 8))
    log_space = magnitude_bias(logfmt.quantize(uniform, 8, rounding="log"))
    assert log_space > 1e-4 and abs(linear) < log_space / 4


@pytest.mark.parametrize("fmt", logfmt.COMBINE_FORMATS)
def test_quantize_moe_output_rounds_forward_and_passes_gradients_straight_through(fmt):
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(1), requires_grad=True)
    upstream = torch.randn(4, 300)
    y = logfmt.quantize_moe_output(x, fmt)
    (y * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)
    assert not torch.equal(y, x) and torch.allclose(y, x, rtol=0.15, atol=0.02)
    if fmt.startswith("logfmt"):
        assert torch.equal(y, logfmt.quantize(x.detach(), int(fmt[6:])))
    if fmt == "bf16":
        assert torch.equal(y, x.detach().to(torch.bfloat16).float())


@pytest.mark.parametrize("fmt, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_combine_uses_one_amax_scale_per_tile(fmt, dtype):
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    y = logfmt.round_trip(x, fmt)
    scale = x.view(4, 128).abs().amax(1, keepdim=True) / torch.finfo(dtype).max
    on_grid = y.view(4, 128) / scale
    assert torch.allclose(on_grid.to(dtype).float(), on_grid, rtol=1e-6, atol=0)  # on the scaled FP8 grid
    assert torch.allclose(on_grid.abs().amax(1), torch.full((4,), torch.finfo(dtype).max))
    with pytest.raises(DSV3Error, match="unknown combine format"):
        logfmt.quantize_moe_output(x, "e3m4")


# --- the study command ----------------------------------------------------------------------------------


def run_cli(args, capsys):
    from dsv3.cli import main

    code = main(["study", "logfmt", *args])
    return code, capsys.readouterr()


def test_study_json_orders_the_formats_as_expected(capsys, tmp_path):
    captured = torch.randn(8, 1000) * torch.rand(8, 1) * 3
    path = tmp_path / "moe_out.pt"
    torch.save({"layer3": captured}, path)
    code, out = run_cli(["--json", "--numel", "32768", "--activations", str(path)], capsys)
    assert code == 0
    result = json.loads(out.out)
    assert set(result["datasets"]) == {"gaussian", "student-t(df=3)", "uniform(-1,1)", "moe_out:layer3"}
    cell = {(r["data"], r["format"]): r for r in result["rows"]}
    for data in result["datasets"]:
        rmse = {fmt: cell[data, fmt]["rel_rmse"] for fmt in result["formats"]}
        assert rmse["bf16"] < rmse["logfmt10"] < rmse["logfmt8"] < rmse["e4m3"] < rmse["e5m2"], data
    assert cell["gaussian", "logfmt8"]["bits_per_element"] == pytest.approx(8 + 64 / 128)
    assert cell["gaussian", "e4m3"]["bits_per_element"] == pytest.approx(8.25)


def test_study_markdown_and_plot(capsys, tmp_path):
    plot = tmp_path / "logfmt.png"
    code, out = run_cli(["--markdown", "--numel", "8192", "--plot", str(plot)], capsys)
    assert code == 0
    assert out.out.startswith("| data | format |") and "| gaussian | logfmt10 |" in out.out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--activations", "/nonexistent/x.pt"], "not found"),
        (["--numel", "10"], "--numel"),
        (["--json", "--markdown"], "choose one"),
        (["--plot", "/nonexistent/dir/p.png"], "directory does not exist"),
    ],
)
def test_study_bad_input_is_one_clear_error(args, message, capsys):
    code, out = run_cli(args, capsys)
    assert code == 2 and message in out.err and out.out == ""


def test_study_refuses_activations_that_are_not_float_tensors(capsys, tmp_path):
    path = tmp_path / "ints.pt"
    torch.save(torch.arange(10), path)
    code, out = run_cli(["--activations", str(path)], capsys)
    assert code == 2 and "floating-point" in out.err

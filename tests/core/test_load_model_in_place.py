"""``torch.load_model`` reading parameters in place: the same model state, return values and
errors as the reference's ``load_model`` (which loads the file and copies), whichever tensors
are read in place and whichever are left to ``load_state_dict``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
ref = pytest.importorskip("safetensors.torch")

import pysafetensors.torch as st_torch  # noqa: E402
from pysafetensors import safe_open  # noqa: E402
from pysafetensors._torch_in_place import in_place_targets  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, dtype: Any = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.block = torch.nn.Sequential(
            torch.nn.Linear(32, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 32)
        )
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor([2.5]))
        self.register_buffer("scratch", torch.ones(3), persistent=False)
        self.to(dtype)


def _bits(model: torch.nn.Module) -> dict[str, bytes]:
    return {
        k: v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for k, v in model.state_dict().items()
    }


def _saved(tmp_path: Path, dtype: Any = torch.float32) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = Net(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model.block[1].running_mean.normal_()
        model.block[1].num_batches_tracked.fill_(7)
    path = tmp_path / "net.safetensors"
    st_torch.save_model(model, path)
    return path, model


def _both(make: Callable[[], torch.nn.Module], path: Path, **kwargs: Any) -> tuple[Any, Any]:
    """Load ``path`` into two fresh models, ours and the reference's; compare their state."""
    torch.manual_seed(1)
    ours_model, ref_model = make(), make()
    # The same starting values (copied directly: load_state_dict would run the models' hooks).
    targets = ref_model.state_dict()
    with torch.no_grad():
        for name, value in ours_model.state_dict().items():
            targets[name].copy_(value)
    ours: Any
    theirs: Any
    try:
        ours = st_torch.load_model(ours_model, path, **kwargs)
    except RuntimeError as exc:
        ours = exc
    kwargs.pop("backend", None)
    try:
        theirs = ref.load_model(ref_model, str(path), **kwargs)
    except RuntimeError as exc:
        theirs = exc
    assert _bits(ours_model) == _bits(ref_model)
    return ours, theirs


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_plain_model_is_read_in_place(tmp_path: Path, backend: str) -> None:
    path, saved = _saved(tmp_path)
    model = Net()
    before = {name: t.data_ptr() for name, t in model.state_dict(keep_vars=True).items()}
    versions = {name: p._version for name, p in model.named_parameters()}
    with safe_open(path, "pt") as f:
        # Everything in the file fits: the tied head is not in it (save_model dropped it).
        assert sorted(in_place_targets(model, f, "cpu")) == sorted(f.keys())
    assert st_torch.load_model(model, path, backend=backend) == (set(), [])
    assert _bits(model) == _bits(saved)
    assert {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()} == before
    assert model.head.weight is model.embed.weight
    # load_state_dict's copy onto itself still counts as a write, as any load does.
    assert all(p._version > versions[name] for name, p in model.named_parameters())


def test_pread_load_leaves_no_second_copy(tmp_path: Path, monkeypatch: Any) -> None:
    """The in-place path reads no tensor of its own: every value handed to load_state_dict is
    the model's tensor itself."""
    path, _ = _saved(tmp_path)
    model = Net()
    own = model.state_dict(keep_vars=True)
    seen: dict[str, Any] = {}
    original = torch.nn.Module.load_state_dict

    def recording(self: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        seen.update(state_dict)
        return original(self, state_dict, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", recording)
    st_torch.load_model(model, path, backend="pread")
    assert sorted(seen) == sorted(name for name in own if name != "head.weight")
    assert all(seen[name] is own[name] for name in seen)


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_dtype_and_shape_mismatches_behave_as_the_reference(tmp_path: Path, backend: str) -> None:
    path, _ = _saved(tmp_path)
    # Another dtype: load_state_dict casts (nothing is read in place).
    ours, theirs = _both(lambda: Net(torch.float64), path, backend=backend)
    assert ours == theirs == (set(), [])

    class Wider(Net):
        def __init__(self) -> None:
            super().__init__()
            self.block[2] = torch.nn.Linear(1024, 48)

    ours, theirs = _both(Wider, path, backend=backend)
    assert isinstance(ours, RuntimeError) and isinstance(theirs, RuntimeError)
    assert str(ours) == str(theirs)
    assert "size mismatch for block.2.weight" in str(ours)


def test_unexpected_and_missing_keys_as_the_reference(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)

    class Fewer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, 32)
            self.extra = torch.nn.Linear(2, 2)

    ours, theirs = _both(Fewer, path, backend="pread", strict=False)
    assert ours == theirs
    ours, theirs = _both(Fewer, path, backend="pread")
    assert str(ours) == str(theirs)


def test_hooks_and_custom_loading_fall_back(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)

    def blend(module: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Reads the parameter's value before the load: reading in place first would change it.
        key = prefix + "embed.weight"
        state_dict[key] = state_dict[key] * 0.5 + module.embed.weight.detach() * 0.5

    def hooked() -> torch.nn.Module:
        model = Net()
        model._register_load_state_dict_pre_hook(blend, with_module=True)
        return model

    with safe_open(path, "pt") as f:
        assert in_place_targets(hooked(), f, "cpu") == {}
    ours, theirs = _both(hooked, path, backend="pread")
    assert ours == theirs

    class Custom(torch.nn.Linear):
        def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"] + self.weight.detach()
            super()._load_from_state_dict(state_dict, prefix, *args)

    class WithCustom(Net):
        def __init__(self) -> None:
            super().__init__()
            self.block[2] = Custom(1024, 32)

    with safe_open(path, "pt") as f:
        assert in_place_targets(WithCustom(), f, "cpu") == {}
    ours, theirs = _both(WithCustom, path, backend="pread")
    assert ours == theirs


def test_unfit_tensors_are_left_to_load_state_dict(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)

    class Transposed(Net):
        def __init__(self) -> None:
            super().__init__()
            # A parameter whose memory is not its tensor's order: copied, not read into.
            self.block[0].weight = torch.nn.Parameter(torch.empty(32, 1024).t())

    model = Transposed()
    with safe_open(path, "pt") as f:
        targets = in_place_targets(model, f, "cpu")
    assert "block.0.weight" not in targets and "block.2.weight" in targets
    st_torch.load_model(model, path, backend="pread")
    assert _bits(model) == _bits(saved)


@pytest.mark.parametrize(
    "layout",
    [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr, torch.Tensor.to_mkldnn],
    ids=["coo", "csr", "mkldnn"],
)
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_tensors_without_plain_memory_fail_as_in_the_reference(
    tmp_path: Path, layout: Callable[[torch.Tensor], torch.Tensor], backend: str
) -> None:
    """A sparse or mkldnn buffer of a name in the file: the in-place path asked for its data
    pointer (or contiguity) and failed first with torch's raw "Cannot access data pointer",
    before anything was loaded; the reference's load_state_dict names the tensor, after
    loading the others."""
    path = tmp_path / "lin.safetensors"
    ref.save_file({"weight": torch.full((3, 4), 2.0), "bias": torch.full((3,), 3.0)}, path)

    def make() -> torch.nn.Module:
        model = torch.nn.Linear(4, 3)
        del model.weight
        model.register_buffer("weight", layout(torch.zeros(3, 4)))
        return model

    errors = []
    for load in (ref.load_model, st_torch.load_model):
        model = make()
        kwargs = {"backend": backend} if load is st_torch.load_model else {}
        with pytest.raises(RuntimeError) as info:
            load(model, path, **kwargs)
        assert 'parameter named "weight"' in str(info.value)
        assert torch.equal(model.bias.detach(), torch.full((3,), 3.0))
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_two_file_names_on_one_memory_are_copied_in_order(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    path = tmp_path / "both.safetensors"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["head.weight"] = torch.randn(64, 32)  # differs from embed.weight in the file
    st_torch.save_file(state, path)
    fresh = Net()
    with safe_open(path, "pt") as f:
        targets = in_place_targets(fresh, f, "cpu")
    assert "embed.weight" not in targets and "head.weight" not in targets
    ours, theirs = _both(Net, path, backend="pread")
    assert str(ours) == str(theirs)


def test_a_tied_name_that_does_not_fit_keeps_the_others_out(tmp_path: Path) -> None:
    # Overlaps were checked among the fitting names only: "head.weight" (float32) was read in
    # place, then load_state_dict copied "embed.weight" (bfloat16 in the file) over it, so the
    # first name's values won where the reference's last one does.
    torch.manual_seed(0)
    model = Net()
    path = tmp_path / "mixed.safetensors"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["embed.weight"] = torch.full((64, 32), 1.0, dtype=torch.bfloat16)
    state["head.weight"] = torch.full((64, 32), 2.0)
    ref.save_file(state, path)
    with safe_open(path, "pt") as f:
        targets = in_place_targets(Net(), f, "cpu")
    assert "head.weight" not in targets and "block.0.weight" in targets
    _both(Net, path, backend="pread", strict=False)
    model = Net()
    st_torch.load_model(model, path, backend="pread", strict=False)
    assert model.embed.weight.unique().tolist() == [2.0]


def test_load_model_from_a_sharded_folder_in_place(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    folder = tmp_path / "sharded"
    st_torch.save_model_sharded(saved, folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    model = Net()
    assert st_torch.load_model(model, folder, backend="pread") == (set(), [])
    assert _bits(model) == _bits(saved)


def test_a_sharded_folder_is_read_in_place_under_mmap_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Viewing every shard's mapping until load_state_dict kept the whole checkpoint mapped
    (a 1.4 GiB model in six shards peaked at 3,080 MiB of RSS against 1,672 MiB in place):
    a sharded load reads the model's tensors in place with the default backend too, while a
    single file is still viewed through its mapping (the one copy is load_state_dict's)."""
    from pysafetensors import ShardedSafeOpen, _reader

    path, saved = _saved(tmp_path)
    folder = tmp_path / "sharded"
    st_torch.save_model_sharded(saved, folder, max_shard_size="100KB")
    read_in_place: list[str] = []
    for cls in (ShardedSafeOpen, _reader.safe_open):
        real = cls.read_into

        def spy(self: Any, targets: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            read_in_place.extend(targets)
            return _real(self, targets, *args, **kwargs)

        monkeypatch.setattr(cls, "read_into", spy)
    model = Net()
    assert st_torch.load_model(model, folder) == (set(), [])
    assert _bits(model) == _bits(saved)
    with safe_open(folder, "pt") as f:
        assert set(read_in_place) == set(f.keys())  # (each shard's read_into notes them too)
    read_in_place.clear()
    model = Net()
    assert st_torch.load_model(model, path) == (set(), [])
    assert _bits(model) == _bits(saved) and read_in_place == []


def test_extra_state_goes_through_set_extra_state(tmp_path: Path) -> None:
    class Counted(Net):
        def __init__(self) -> None:
            super().__init__()
            self.seen = torch.zeros(4)
            self.calls = 0

        def get_extra_state(self) -> Any:
            return self.seen

        def set_extra_state(self, state: Any) -> None:
            self.calls += 1
            self.seen = state.clone() + 1

    torch.manual_seed(0)
    saved = Counted()
    saved.seen = torch.arange(4.0)
    path = tmp_path / "extra.safetensors"
    st_torch.save_model(saved, path)
    model = Counted()
    with safe_open(path, "pt") as f:
        assert "_extra_state" in f
        assert "_extra_state" not in in_place_targets(model, f, "cpu")
    ours, theirs = _both(Counted, path, backend="pread")
    assert ours == theirs
    st_torch.load_model(model, path, backend="pread")
    assert model.calls == 1 and torch.equal(model.seen, torch.arange(4.0) + 1)


def test_a_mapped_cpu_load_copies_out_of_the_mapping(tmp_path: Path) -> None:
    from pysafetensors._torch_in_place import maps_file

    path, saved = _saved(tmp_path)
    with safe_open(path, "pt") as f:
        assert maps_file(f, path, "mmap") and maps_file(f, str(path), "mmap")
        assert not maps_file(f, path, "pread")
        assert not maps_file(f, "https://host/model.safetensors", "mmap")
        with open(path, "rb") as fileobj:
            assert not maps_file(f, fileobj, "mmap")
    model = Net()
    with safe_open(path, "pt") as f:
        assert in_place_targets(model, f, "cpu", mapped=True) == {}
    assert st_torch.load_model(model, path) == (set(), [])
    assert _bits(model) == _bits(saved)


def _refused(model: torch.nn.Module, path: Path, error: type[Exception]) -> None:
    """Load ``path`` into ``model`` read in place: refused, and the model is unchanged."""
    before = _bits(model)
    with pytest.raises(error):
        st_torch.load_model(model, path, strict=False, backend="pread")
    assert _bits(model) == before


def test_a_refused_load_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    # Parameters that are views of one flat buffer (none covering it): the reference refuses
    # them before it touches the model; reading in place came first and overwrote them.
    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            flat = torch.zeros(6)
            self.lin = torch.nn.Linear(2, 2)
            self.lin.weight = torch.nn.Parameter(flat[:4].view(2, 2))
            self.lin.bias = torch.nn.Parameter(flat[4:])

    path = tmp_path / "flat.safetensors"
    st_torch.save_file({"lin.weight": torch.full((2, 2), 7.0), "lin.bias": torch.ones(2)}, path)
    with safe_open(path, "pt") as f:
        assert in_place_targets(Flat(), f, "cpu")  # the model is one read in place
    _refused(Flat(), path, RuntimeError)
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        ref.load_model(Flat(), str(path))

    # A tensor of the file that torch cannot hold (F4 with an odd last dimension).
    odd = tmp_path / "odd.safetensors"
    header = (
        b'{"weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
        b'"bias":{"dtype":"F32","shape":[2],"data_offsets":[16,24]},'
        b'"extra":{"dtype":"F4","shape":[2,3],"data_offsets":[24,27]}}'
    )
    header += b" " * (-len(header) % 8)
    data = torch.full((6,), 7.0).numpy().tobytes() + b"\0\0\0"
    odd.write_bytes(len(header).to_bytes(8, "little") + header + data)
    torch.manual_seed(0)
    _refused(torch.nn.Linear(2, 2), odd, TypeError)

    # A damaged shard that holds only a name the model lacks (an unexpected key).
    class Big(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.register_buffer("z_extra", torch.zeros(64))

    folder = tmp_path / "sharded"
    st_torch.save_model_sharded(Big(), folder, max_shard_size=300)
    shards = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert shards["z_extra"] != shards["a.weight"]
    with open(folder / shards["z_extra"], "r+b") as f:
        f.seek(8)
        f.write(b"!")  # the header is no longer JSON
    model = torch.nn.Module()
    model.a = torch.nn.Linear(8, 8)
    _refused(model, folder, ValueError)


def _loads_the_plain_way(make: Callable[[], torch.nn.Module], path: Path) -> None:
    """Save ``make()``; nothing of a fresh one is read in place, and a load ends as the
    reference's does."""
    st_torch.save_model(make(), path)
    with safe_open(path, "pt") as f:
        assert in_place_targets(make(), f, "cpu") == {}
    ours, theirs = _both(make, path, backend="pread")
    assert ours == theirs


def test_code_run_in_the_middle_of_the_load_sees_what_the_reference_does(
    tmp_path: Path,
) -> None:
    # torch loads a module's tensors, then sets its extra state, then loads its children, then
    # runs its post hooks. Tensors read in place before all that would keep what such code
    # wrote into them (their copy is skipped), where the reference's copy overwrites it.
    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = torch.nn.Linear(2, 2, bias=False)

        def get_extra_state(self) -> Any:
            return torch.tensor([2.0])

        def set_extra_state(self, state: Any) -> None:
            with torch.no_grad():
                self.child.weight.mul_(state)

    _loads_the_plain_way(Parent, tmp_path / "extra.safetensors")

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(2, 2, bias=False)
            self.b = torch.nn.Linear(2, 2, bias=False)

            def hook(module: Any, incompatible: Any) -> None:
                with torch.no_grad():
                    self.b.weight.copy_(module.weight * 10)

            self.a.register_load_state_dict_post_hook(hook)

    _loads_the_plain_way(Two, tmp_path / "two.safetensors")

    # The root's own post hooks run after every copy: reading in place stays.
    def rooted() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        model.register_load_state_dict_post_hook(lambda module, incompatible: None)
        return model

    path = tmp_path / "rooted.safetensors"
    st_torch.save_model(rooted(), path)
    with safe_open(path, "pt") as f:
        assert in_place_targets(rooted(), f, "cpu")

import pytest

from posttrain.registry import Registry, resolve_many


def test_register_and_get():
    reg = Registry("loss_type")

    @reg.register("sigmoid")
    def sigmoid(x):
        return x

    assert reg.get("sigmoid") is sigmoid
    assert "sigmoid" in reg and reg.names() == ["sigmoid"] and len(reg) == 1


def test_unknown_name_lists_valid_names():
    reg = Registry("loss_type")
    reg.add("b", lambda: 1)
    reg.add("a", lambda: 2)
    with pytest.raises(ValueError, match=r"Unknown loss_type 'c'\. Valid names: a, b\."):
        reg.get("c")


def test_callables_pass_through_and_bad_types_rejected():
    reg = Registry("thing")

    def f():
        return 0

    assert reg.get(f) is f
    with pytest.raises(TypeError, match="Expected a thing name"):
        reg.get(3)
    assert resolve_many(reg, f) == [f]


def test_duplicate_registration_rejected():
    reg = Registry("thing")
    reg.add("x", 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.add("x", 2)
    reg.add("x", 3, overwrite=True)
    assert reg.get("x") == 3

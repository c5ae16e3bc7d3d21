"""CUDA device memory given to hxfer.Memory: torch cuda tensors, __cuda_array_interface__ and
DLPack capsules are read as device buffers (pointer, size, device ordinal) without a GPU and
handed to the device runtime, which refuses these stand-ins naming the pool and the device:
Unavailable where there is no CUDA (this machine), InvalidArgument where CUDA finds no device
memory at their address. Malformed ones name what is wrong. The objects here are stand-ins
that speak each protocol: no GPU is touched (nothing reads their addresses)."""

import ctypes
import types

import pytest

import hxfer
from pages import numpy_pools, tiny_layout
from test_errors import raises

FAKE_DEVICE_PTR = 0x7F00_0000_0000  # never dereferenced: only the CUDA runtime looks it up


@pytest.fixture
def lay():
    return tiny_layout("vllm")


def first_pool(lay):
    return lay.pools()[0]["name"], lay.pools()[0]["bytes"]


class CudaTensor:
    """What hxfer reads of a torch tensor on cuda:N."""

    def __init__(self, nbytes, index, contiguous=True):
        self.device = types.SimpleNamespace(type="cuda", index=index)
        self._n = nbytes
        self._contiguous = contiguous

    def data_ptr(self):
        return FAKE_DEVICE_PTR

    def is_contiguous(self):
        return self._contiguous

    def numel(self):
        return self._n

    def element_size(self):
        return 1


class CudaArray:
    """An object exposing __cuda_array_interface__ (version 3), and a DLPack device if given."""

    def __init__(self, nbytes, device=None, strides=None, readonly=False, typestr="|u1"):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": typestr, "data": (FAKE_DEVICE_PTR, readonly),
            "strides": strides, "version": 3}
        if device is not None:
            self.__dlpack_device__ = lambda: device


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # the dying capsule, not touched
ctypes.pythonapi.PyCapsule_New.restype = ctypes.c_void_p
ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
ctypes.pythonapi.Py_DecRef.argtypes = [ctypes.c_void_p]


def new_capsule(pointer, name, destructor):
    """PyCapsule_New's new reference as a Python object that owns it."""
    raw = ctypes.pythonapi.PyCapsule_New(pointer, name, destructor)
    capsule = ctypes.cast(raw, ctypes.py_object).value  # a second reference
    ctypes.pythonapi.Py_DecRef(raw)
    return capsule


class DlpackArray:
    """A DLPack producer: __dlpack_device__() and __dlpack__() giving a 'dltensor' capsule over
    ctypes structs; `released` counts capsules whose destructor ran."""

    def __init__(self, shape, device=(2, 0), strides=None, bits=8):
        self.device = device
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        self.managed = DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = FAKE_DEVICE_PTR
        t.device = DLDevice(*device)
        t.ndim = len(shape)
        t.dtype = DLDataType(1, bits, 1)
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            t.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 256
        self.released = 0
        self._destructor = CAPSULE_DESTRUCTOR(self._release)

    def _release(self, capsule):
        self.released += 1

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        return new_capsule(ctypes.addressof(self.managed), b"dltensor",
                           ctypes.cast(self._destructor, ctypes.c_void_p))


def refused(lay, name, obj, code):
    bufs = numpy_pools(lay)
    bufs[name] = obj
    with raises(code) as e:
        hxfer.Memory(lay, bufs)
    assert f"pool {name}: " in e.value.message, e.value.message
    return e.value.message


def refused_as_device_memory(lay, name, obj, device):
    """`obj` reached the device runtime as memory of CUDA device `device`, which refused it."""
    bufs = numpy_pools(lay)
    bufs[name] = obj
    with pytest.raises(hxfer.Error) as e:
        hxfer.Memory(lay, bufs)
    msg = e.value.message
    assert f"pool {name}: " in msg, msg
    if e.value.code == "Unavailable":  # no CUDA here
        assert f"memory of CUDA device {device} cannot be moved here: " in msg, msg
    else:  # CUDA, and no device memory at the stand-in's address
        assert e.value.code == "InvalidArgument", msg
        assert f"bytes of device memory (CUDA device {device}" in msg, msg
    return msg


def test_torch_cuda_tensor_goes_to_the_device_runtime(lay):
    name, n = first_pool(lay)
    refused_as_device_memory(lay, name, CudaTensor(n, index=1), 1)


def test_non_contiguous_cuda_tensor_is_named(lay):
    name, n = first_pool(lay)
    msg = refused(lay, name, CudaTensor(n, index=0, contiguous=False), "InvalidArgument")
    assert "not contiguous" in msg


def test_cuda_array_interface_takes_its_device_from_dlpack(lay):
    name, n = first_pool(lay)
    refused_as_device_memory(lay, name, CudaArray(n, device=(2, 3)), 3)


def test_cuda_array_interface_without_a_device_is_named(lay):
    name, n = first_pool(lay)
    msg = refused(lay, name, CudaArray(n), "InvalidArgument")
    assert "CUDA memory of no known device" in msg and "__dlpack_device__" in msg


@pytest.mark.parametrize("kwargs, words", [
    ({"strides": (2,)}, "not contiguous (stride 2 where 1 would be)"),
    ({"readonly": True}, "read-only"),
    ({"typestr": "|u"}, "typestr '|u' has no size"),
])
def test_malformed_cuda_array_interface_is_named(lay, kwargs, words):
    name, n = first_pool(lay)
    msg = refused(lay, name, CudaArray(n, device=(2, 0), **kwargs), "InvalidArgument")
    assert words in msg


def test_dlpack_capsule_is_read_and_handed_back(lay):
    name, n = first_pool(lay)
    arr = DlpackArray((n // 4, 4), device=(2, 2))
    refused_as_device_memory(lay, name, arr, 2)
    assert arr.released == 1, "the capsule hxfer took was not released"


def test_dlpack_non_contiguous_is_named(lay):
    name, n = first_pool(lay)
    arr = DlpackArray((4, n // 4), strides=(1, 4))  # column-major
    msg = refused(lay, name, arr, "InvalidArgument")
    assert "not contiguous" in msg
    assert arr.released == 1


@pytest.mark.parametrize("device, words", [
    ((10, 0), "DLPack device type 10"),
    ((3, 0), "CUDA pinned host memory"),
])
def test_dlpack_devices_hxfer_does_not_take_are_named(lay, device, words):
    name, n = first_pool(lay)
    msg = refused(lay, name, DlpackArray((n,), device=device), "InvalidArgument")
    assert words in msg


def test_dlpack_on_the_cpu_is_left_to_the_host_paths(lay):
    name, n = first_pool(lay)
    msg = refused(lay, name, DlpackArray((n,), device=(1, 0)), "InvalidArgument")
    assert "expected a writable buffer" in msg


class RecordedEvent:
    """What hxfer reads of a torch.cuda.Event: its cudaEvent_t as an int."""

    def __init__(self, handle):
        self.cuda_event = handle


def host_pair(lay):
    mem = hxfer.Memory(lay, numpy_pools(lay))
    tx = hxfer.Sender(lay, mem, backend="inproc")
    return mem, tx


def test_events_with_host_pools_are_refused_naming_them(lay):
    mem, tx = host_pair(lay)
    assert not mem.device
    with tx:
        for ev in (RecordedEvent(0x1234), 0x1234):
            with raises("InvalidArgument") as e:
                tx.mark_ready(1, [0, 1], 0, ready_event=ev)
            assert "a DeviceEvent given with pools in host memory" in e.value.message
        assert not tx.holds(1)


@pytest.mark.parametrize("ev, words", [
    ("event", "ready_event must be a torch.cuda.Event or a cudaEvent_t as an int, got str"),
    (RecordedEvent("x"), "ready_event: the event handle is not an address, got str"),
])
def test_events_of_the_wrong_type_are_named(lay, ev, words):
    _, tx = host_pair(lay)
    with tx:
        with pytest.raises(TypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
            tx.mark_ready(1, [0, 1], 0, ready_event=ev)

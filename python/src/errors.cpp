// C++ errors -> the Python classes of tensor_ops.errors.
#include <nanobind/nanobind.h>

#include "tensor_ops/errors.h"

namespace nb = nanobind;

namespace tensor_ops::python {

void init_errors(nb::module_&) {
  // tensor_ops.errors is imported at the first error, not here: importing
  // the package while _C initialises would load whatever tensor_ops is
  // installed, and nanobind's stubgen imports the freshly built _C alone,
  // where an older installed _C then fails to link against the new core (or,
  // with none installed, the import fails). Leaked on purpose: a static
  // nb::object would be released after the interpreter is finalised (a
  // crash at exit). Translators run with the GIL held.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    static PyObject* mod = nullptr;
    auto raise = [](const char* cls, const std::exception& e) {
      if (!mod) {
        PyObject* m = PyImport_ImportModule("tensor_ops.errors");
        if (!m) return;  // the ImportError is the error raised
        mod = m;
      }
      nb::object type = nb::borrow(mod).attr(cls);
      PyErr_SetString(type.ptr(), e.what());
    };
    try {
      std::rethrow_exception(p);
    } catch (const LayoutError& e) {
      raise("LayoutError", e);
    } catch (const DTypeError& e) {
      raise("DTypeError", e);
    } catch (const InvalidArgument& e) {
      raise("InvalidArgumentError", e);
    } catch (const ExternalBackendSelected& e) {
      raise("ExternalBackendSelected", e);
    } catch (const Unsupported& e) {
      raise("UnsupportedError", e);
    } catch (const BackendUnavailable& e) {
      raise("BackendUnavailableError", e);
    } catch (const OutOfMemory& e) {
      raise("OutOfMemoryError", e);
    } catch (const DeviceError& e) {
      raise("DeviceError", e);
    } catch (const Error& e) {
      raise("TensorOpsError", e);
    }
  });
}

}  // namespace tensor_ops::python

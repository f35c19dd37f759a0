//! Status codes, the error type every fallible function returns, and the per-thread last error.

use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::fmt;

pub use crate::abi::engine_status;
pub use engine_status as Status;

impl engine_status {
    /// A static C string, so `engine_status_str` can hand out the pointer.
    pub fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            Status::Ok => c"ok",
            Status::InvalidArgument => c"invalid argument",
            Status::NoRoom => c"no room",
            Status::NoCuda => c"built without nvcc",
            Status::NoDevice => c"no CUDA device",
            Status::CudaError => c"CUDA error",
            Status::IoError => c"I/O error",
            Status::BadModel => c"bad model",
            Status::Unsupported => c"unsupported",
            Status::OutOfRange => c"out of range",
            Status::Panic => c"panic inside hostembed",
        }
    }

    pub fn as_str(self) -> &'static str {
        self.c_name().to_str().unwrap_or("?")
    }
}

/// A failure with its status and a message for `engine_last_error()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Error { status, message: message.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.as_str(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// `bail!(BadModel, "{}: tensor {} ...", ...)` returns an `Err` with that status and message.
#[macro_export]
macro_rules! bail {
    ($status:ident, $($fmt:tt)+) => {
        return Err($crate::status::Error::new($crate::status::Status::$status, format!($($fmt)+)))
    };
}

/// `err!(BadModel, ...)` builds the error without returning, for `ok_or_else` and `map_err`.
#[macro_export]
macro_rules! err {
    ($status:ident, $($fmt:tt)+) => {
        $crate::status::Error::new($crate::status::Status::$status, format!($($fmt)+))
    };
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records the message `engine_last_error()` returns on this thread.
pub fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

pub fn clear_last_error() {
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::default());
}

/// The message as Rust text (tests read it this way).
pub fn last_error() -> String {
    LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned())
}

/// Pointer valid until the next failing call on this thread.
pub(crate) fn last_error_ptr() -> *const std::os::raw::c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

thread_local! {
    /// True while this thread runs code whose panics are caught and reported as a status.
    static INSIDE_BOUNDARY: Cell<bool> = const { Cell::new(false) };
}

/// Installs, once per process, a panic hook that stays silent for panics caught inside the library and
/// hands every other panic to the hook that was there before, so the host's stderr stays the host's.
fn install_quiet_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !INSIDE_BOUNDARY.with(Cell::get) {
                previous(info);
            }
        }));
    });
}

/// `catch_unwind` whose panics print nothing: the caller turns them into a status and a message.
pub fn catch_quietly<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    install_quiet_hook();
    let was_inside = INSIDE_BOUNDARY.with(|b| b.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    INSIDE_BOUNDARY.with(|b| b.set(was_inside));
    result
}

/// The text a panic carried ("unknown panic" when it was neither a string nor a message).
pub fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

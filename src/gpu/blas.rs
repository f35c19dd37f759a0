//! cuBLASLt for the matrix products of prompt chunks, loaded at run time with dlopen and never linked,
//! so the library links, loads and runs where no CUDA library is installed. Without it (or with
//! `Tuning::cublaslt` off: `HOSTEMBED_CUBLASLT=0`) the products run on this library's own tensor-core
//! kernel; the engine logs which one it uses. `HOSTEMBED_CUBLASLT=/path/libcublasLt.so.13` names the
//! file to load.
//!
//! The declarations are written by hand, like the runtime's in `cudart.rs`; the values below are the
//! ones `cublasLt.h` gives (CUDA 11 to 13 share them). The GPU suite runs the prompt tests once on
//! cuBLASLt and once more with `HOSTEMBED_CUBLASLT=0`, each against the CPU backend.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::{Mutex, PoisonError};

use super::launch::HalfMatrix;
use crate::cudart::cudaStream_t;
use crate::status::Result;
use crate::tensor::DType;
use crate::tuning::{CUBLASLT_ENV, Cublaslt};
use crate::{bail, err};

/// Tried in order when the tuning names no file.
const LIBRARY_NAMES: [&str; 3] = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"];
/// Device bytes the products may use as workspace (part of the scratch allocation).
pub const WORKSPACE_BYTES: usize = 32 << 20;

// cublasLt.h values.
const CUBLAS_STATUS_SUCCESS: c_int = 0;
const CUBLAS_COMPUTE_32F: c_int = 68;
const CUDA_R_32F: c_int = 0;
const CUDA_R_16F: c_int = 2;
const CUDA_R_16BF: c_int = 14;
const CUBLAS_OP_N: c_int = 0;
const CUBLAS_OP_T: c_int = 1;
const CUBLASLT_MATMUL_DESC_TRANSA: c_int = 3;
const CUBLASLT_MATMUL_DESC_TRANSB: c_int = 4;
const CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: c_int = 1;

type Handle = *mut c_void;
type Status = c_int;

/// `cublasLtMatmulHeuristicResult_t`: the algorithm (opaque, 8 words) and what the search says of it.
#[repr(C)]
#[derive(Clone, Copy)]
struct HeuristicResult {
    algo: [u64; 8],
    workspace_size: usize,
    state: Status,
    waves_count: f32,
    reserved: [c_int; 4],
}
const _: () = assert!(std::mem::size_of::<HeuristicResult>() == 96);

/// The entry points, resolved once per process.
struct Api {
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy: unsafe extern "C" fn(Handle) -> Status,
    desc_create: unsafe extern "C" fn(*mut Handle, c_int, c_int) -> Status,
    desc_set: unsafe extern "C" fn(Handle, c_int, *const c_void, usize) -> Status,
    desc_destroy: unsafe extern "C" fn(Handle) -> Status,
    layout_create: unsafe extern "C" fn(*mut Handle, c_int, u64, u64, i64) -> Status,
    layout_destroy: unsafe extern "C" fn(Handle) -> Status,
    pref_create: unsafe extern "C" fn(*mut Handle) -> Status,
    pref_set: unsafe extern "C" fn(Handle, c_int, *const c_void, usize) -> Status,
    pref_destroy: unsafe extern "C" fn(Handle) -> Status,
    #[allow(clippy::type_complexity)]
    heuristic: unsafe extern "C" fn(
        Handle,
        Handle,
        Handle,
        Handle,
        Handle,
        Handle,
        Handle,
        c_int,
        *mut HeuristicResult,
        *mut c_int,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    matmul: unsafe extern "C" fn(
        Handle,
        Handle,
        *const c_void,
        *const c_void,
        Handle,
        *const c_void,
        Handle,
        *const c_void,
        *const c_void,
        Handle,
        *mut c_void,
        Handle,
        *const c_void,
        *mut c_void,
        usize,
        cudaStream_t,
    ) -> Status,
}

/// The loaded library's entry points and the file they came from (never unloaded: it may have
/// registered exit handlers).
struct Library {
    api: Api,
    name: String,
}

// SAFETY: function pointers into a library that stays loaded; cuBLASLt's entry points are thread-safe.
unsafe impl Send for Library {}
// SAFETY: as for Send.
unsafe impl Sync for Library {}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc, read before the next dl call.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

fn open(name: &str) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(name).map_err(|_| format!("{name}: a NUL in the name"))?;
    // SAFETY: a NUL-terminated file name; dlopen reports failure as NULL.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() { Err(dl_error()) } else { Ok(h) }
}

/// Resolves `name` in `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the C signature of `name`.
pub(super) unsafe fn symbol<F: Copy>(lib: *mut c_void, name: &CStr) -> std::result::Result<F, String> {
    // SAFETY: `lib` is a handle dlopen returned; the name is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("no {} in it", name.to_string_lossy()));
    }
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: a non-NULL code address of the symbol whose signature the caller vouches for.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

fn load_library(choice: &Cublaslt) -> std::result::Result<Library, String> {
    let names: Vec<String> = match choice {
        Cublaslt::Off => return Err(format!("{CUBLASLT_ENV}=0")),
        Cublaslt::File(name) => vec![name.clone()],
        Cublaslt::Default => LIBRARY_NAMES.iter().map(|s| s.to_string()).collect(),
    };
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    first_library(&names, |lib, name| {
        // SAFETY: each type below is the signature cublasLt.h declares for that name.
        let api = unsafe {
            Api {
                create: symbol(lib, c"cublasLtCreate")?,
                destroy: symbol(lib, c"cublasLtDestroy")?,
                desc_create: symbol(lib, c"cublasLtMatmulDescCreate")?,
                desc_set: symbol(lib, c"cublasLtMatmulDescSetAttribute")?,
                desc_destroy: symbol(lib, c"cublasLtMatmulDescDestroy")?,
                layout_create: symbol(lib, c"cublasLtMatrixLayoutCreate")?,
                layout_destroy: symbol(lib, c"cublasLtMatrixLayoutDestroy")?,
                pref_create: symbol(lib, c"cublasLtMatmulPreferenceCreate")?,
                pref_set: symbol(lib, c"cublasLtMatmulPreferenceSetAttribute")?,
                pref_destroy: symbol(lib, c"cublasLtMatmulPreferenceDestroy")?,
                heuristic: symbol(lib, c"cublasLtMatmulAlgoGetHeuristic")?,
                matmul: symbol(lib, c"cublasLtMatmul")?,
            }
        };
        Ok(Library { api, name: name.to_string() })
    })
}

/// The first of `names` that opens and that `resolve` takes (its entry points found, say), or every
/// reason why none did.
pub(super) fn first_library<T>(
    names: &[&str],
    mut resolve: impl FnMut(*mut c_void, &str) -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    let mut tried = Vec::new();
    for &name in names {
        match open(name).and_then(|lib| resolve(lib, name).map_err(|e| format!("{name}: {e}"))) {
            Ok(loaded) => return Ok(loaded),
            Err(e) => tried.push(e),
        }
    }
    Err(tried.join("; "))
}

/// The cuBLASLt `choice` asks for, or why there is none: loaded once a process for each choice, and
/// kept (a library is never unloaded while a handle of it may live).
fn library(choice: &Cublaslt) -> std::result::Result<&'static Library, String> {
    type Loaded = &'static std::result::Result<Library, String>;
    static LOADED: Mutex<Vec<(Cublaslt, Loaded)>> = Mutex::new(Vec::new());
    let mut loaded = LOADED.lock().unwrap_or_else(PoisonError::into_inner);
    let lib = match loaded.iter().find(|(c, _)| c == choice) {
        Some(&(_, lib)) => lib,
        None => {
            let lib: Loaded = Box::leak(Box::new(load_library(choice)));
            loaded.push((choice.clone(), lib));
            lib
        }
    };
    lib.as_ref().map_err(String::clone)
}

fn check(status: Status, what: &str) -> Result<()> {
    if status != CUBLAS_STATUS_SUCCESS {
        bail!(CudaError, "{what}: cuBLAS status {status}");
    }
    Ok(())
}

/// One product's shapes: (format, weight rows, cols, tokens, lda, ldy).
type Key = (DType, usize, usize, usize, usize, usize);

/// The layouts and algorithm cuBLASLt chose for one shape.
struct Plan {
    layouts: [Handle; 3],
    algo: [u64; 8],
}

/// A cuBLASLt handle on the current device, its one operation descriptor (f32 compute, y^T = W a^T in
/// column-major terms) and the plans of the shapes seen so far.
pub(super) struct Blas {
    lib: &'static Library,
    handle: Handle,
    desc: Handle,
    pref: Handle,
    plans: RefCell<HashMap<Key, Option<Plan>>>,
}

// SAFETY: cuBLASLt handles may be used from any thread, one at a time; the engine serializes steps.
unsafe impl Send for Blas {}

impl Blas {
    /// The cuBLASLt `choice` names on the current device, or the reason it is not used (for the engine's
    /// log line).
    pub(super) fn new(choice: &Cublaslt) -> std::result::Result<Blas, String> {
        let lib = library(choice)?;
        let a = &lib.api;
        let mut b = Blas {
            lib,
            handle: ptr::null_mut(),
            desc: ptr::null_mut(),
            pref: ptr::null_mut(),
            plans: Default::default(),
        };
        let ws = WORKSPACE_BYTES as u64;
        let (op_t, op_n) = (CUBLAS_OP_T, CUBLAS_OP_N);
        let set = |desc: Handle, attr: c_int, v: &c_int| {
            // SAFETY: a live descriptor and a value of the attribute's type (cublasOperation_t, an int).
            unsafe { (a.desc_set)(desc, attr, v as *const c_int as *const c_void, std::mem::size_of::<c_int>()) }
        };
        // SAFETY: each call writes the handle it creates into a field that Drop destroys when non-NULL.
        let made = unsafe {
            check((a.create)(&mut b.handle), "cublasLtCreate")
                .and_then(|_| {
                    check((a.desc_create)(&mut b.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate")
                })
                .and_then(|_| check(set(b.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t), "cublasLtMatmulDescSetAttribute"))
                .and_then(|_| check(set(b.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n), "cublasLtMatmulDescSetAttribute"))
                .and_then(|_| check((a.pref_create)(&mut b.pref), "cublasLtMatmulPreferenceCreate"))
                .and_then(|_| {
                    let v = &ws as *const u64 as *const c_void;
                    check(
                        (a.pref_set)(b.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, v, 8),
                        "cublasLtMatmulPreferenceSetAttribute",
                    )
                })
        };
        made.map(|_| b).map_err(|e| format!("{}: {}", lib.name, e.message))
    }

    /// The file the products come from.
    pub(super) fn name(&self) -> &str {
        &self.lib.name
    }

    fn plan_for(&self, key: Key) -> Option<Plan> {
        let (dtype, rows, cols, n, lda, ldy) = key;
        let a = &self.lib.api;
        let half = if dtype == DType::Bf16 { CUDA_R_16BF } else { CUDA_R_16F };
        let mut layouts = [ptr::null_mut(); 3];
        let shapes = [(half, cols, rows, cols), (half, cols, n, lda), (CUDA_R_32F, rows, n, ldy)];
        let mut ok = true;
        for (l, &(t, r, c, ld)) in layouts.iter_mut().zip(&shapes) {
            // SAFETY: writes a new layout handle into `l`; destroyed below or by Plan's owner.
            ok &= unsafe { (a.layout_create)(l, t, r as u64, c as u64, ld as i64) } == CUBLAS_STATUS_SUCCESS;
        }
        let mut result =
            HeuristicResult { algo: [0; 8], workspace_size: 0, state: 0, waves_count: 0.0, reserved: [0; 4] };
        let mut found: c_int = 0;
        if ok {
            let [wl, al, yl] = layouts;
            // SAFETY: live descriptor, layouts and preference; room for the one result asked for.
            let st =
                unsafe { (a.heuristic)(self.handle, self.desc, wl, al, yl, yl, self.pref, 1, &mut result, &mut found) };
            ok = st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
        }
        let plan = Plan { layouts, algo: result.algo };
        if ok {
            Some(plan)
        } else {
            self.destroy(plan);
            None
        }
    }

    fn destroy(&self, plan: Plan) {
        for l in plan.layouts.into_iter().filter(|l| !l.is_null()) {
            // SAFETY: a layout this struct created and nothing else holds.
            unsafe { (self.lib.api.layout_destroy)(l) };
        }
    }

    /// y[t] = w a[t] (+ residual[t]) for `n` tokens, when cuBLASLt has an algorithm for the shape and
    /// every pointer is 256-byte aligned (what its heuristics assume); false to use the own kernel.
    pub(super) fn matmul(
        &self,
        a_ptr: *const c_void,
        lda: usize,
        w: &HalfMatrix,
        n: usize,
        residual: *const f32,
        y: *mut f32,
        ldy: usize,
        workspace: *mut c_void,
        s: cudaStream_t,
    ) -> Result<bool> {
        let aligned = [a_ptr as usize, w.ptr as usize, residual as usize, y as usize, workspace as usize]
            .iter()
            .all(|p| p % 256 == 0);
        if !aligned {
            return Ok(false);
        }
        let key = (w.dtype, w.rows, w.cols, n, lda, ldy);
        let mut plans = self.plans.borrow_mut();
        let plan = plans.entry(key).or_insert_with(|| self.plan_for(key));
        let Some(plan) = plan else { return Ok(false) };
        let (alpha, beta) = (1f32, if residual.is_null() { 0f32 } else { 1f32 });
        let c = if residual.is_null() { y as *const c_void } else { residual as *const c_void };
        let [wl, al, yl] = plan.layouts;
        // SAFETY: device pointers sized for these layouts (the caller's shapes), host scalars, a live
        // handle, descriptor and algorithm, and a workspace of WORKSPACE_BYTES.
        let st = unsafe {
            (self.lib.api.matmul)(
                self.handle,
                self.desc,
                &alpha as *const f32 as *const c_void,
                w.ptr,
                wl,
                a_ptr,
                al,
                &beta as *const f32 as *const c_void,
                c,
                yl,
                y as *mut c_void,
                yl,
                plan.algo.as_ptr() as *const c_void,
                workspace,
                WORKSPACE_BYTES,
                s,
            )
        };
        check(st, "cublasLtMatmul").map_err(|e| err!(CudaError, "{} ({})", e.message, self.lib.name))?;
        Ok(true)
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let plans: Vec<Plan> = self.plans.get_mut().drain().filter_map(|(_, p)| p).collect();
        for p in plans {
            self.destroy(p);
        }
        let a = &self.lib.api;
        // SAFETY: handles this struct created (NULL when creation failed), each destroyed once.
        unsafe {
            if !self.pref.is_null() {
                (a.pref_destroy)(self.pref);
            }
            if !self.desc.is_null() {
                (a.desc_destroy)(self.desc);
            }
            if !self.handle.is_null() {
                (a.destroy)(self.handle);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where cuBLASLt is not loaded, the reason names what was asked for; nothing here needs a device.
    #[test]
    fn a_library_that_cannot_load_says_why() {
        let with = |choice: Cublaslt| load_library(&choice).map(|lib| lib.name);
        assert_eq!(with(Cublaslt::Off).unwrap_err(), "HOSTEMBED_CUBLASLT=0");
        let absent = "/nonexistent/libcublasLt.so.13";
        assert!(with(Cublaslt::File(absent.into())).unwrap_err().contains(absent));
        // A library that loads but is not cuBLASLt.
        let not_blas = with(Cublaslt::File("libc.so.6".into())).unwrap_err();
        assert!(not_blas.starts_with("libc.so.6: no cublasLtCreate in it"), "{not_blas}");
        // The default names, tried in order: where none loads, each says why.
        if let Err(why) = with(Cublaslt::Default) {
            assert!(why.contains("libcublasLt.so.13") && why.contains("libcublasLt.so.12"), "{why}");
        }
        // Each choice is loaded once and kept: asking again gives the same answer.
        assert_eq!(library(&Cublaslt::Off).map(|l| l.name.clone()), Err("HOSTEMBED_CUBLASLT=0".to_string()));
        assert_eq!(library(&Cublaslt::Off).map(|l| l.name.clone()), Err("HOSTEMBED_CUBLASLT=0".to_string()));
    }
}

//! Loading `libnixl_capi.so`: every declared symbol resolves in the wheel's library, the library
//! is not NIXL's stub, and anything else is refused with every missing name.
//!
//! The NIXL tests need `KVPUSH_NIXL_CAPI=<abs path of libnixl_capi.so>`; without it they print
//! SKIP and pass, so the crate tests everywhere, unless `KVPUSH_REQUIRE_NIXL` is set (as CI
//! sets it): then they fail.

mod common;

use common::capi_path;
use kvpush_nixl::{Library, LoadError, SYMBOLS};

#[test]
fn the_wheel_library_has_every_declared_symbol_and_is_not_a_stub() {
    let Some(path) = capi_path() else { return };
    let library = Library::load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(library.path(), std::path::Path::new(&path));

    // Independently of the loader: dlsym every name kvpush declares.
    // SAFETY: the library is already loaded by `Library::load` (this only takes a reference);
    // its initialisers have run.
    let raw = unsafe {
        libloading::os::unix::Library::open(
            Some(&path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    }
    .unwrap();
    let missing: Vec<&str> = SYMBOLS
        .iter()
        .copied()
        // SAFETY: only the symbol's address is looked up; nothing is called through `*const u8`.
        .filter(|name| unsafe { raw.get::<*const u8>(name.as_bytes()) }.is_err())
        .collect();
    assert!(missing.is_empty(), "missing: {missing:?}");
    // SAFETY: `nixl_capi_is_stub` is `bool (void)` in wrapper.h.
    let is_stub =
        unsafe { raw.get::<unsafe extern "C" fn() -> bool>(b"nixl_capi_is_stub") }.unwrap();
    // SAFETY: as above; it takes no arguments.
    assert!(!unsafe { is_stub() }, "the real library says it is not a stub");
    eprintln!("{} NIXL C API symbols resolve in {path}", SYMBOLS.len());
    let _leak = raw.into_raw();
}

#[test]
fn a_library_without_nixl_is_refused_naming_every_missing_symbol() {
    // The C library this test runs on: always present, never NIXL.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let libc = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.contains("/libc.so") || path.contains("/libc-"))
        .expect("libc is mapped");
    match Library::load(libc) {
        Err(LoadError::MissingSymbols { missing, .. }) => {
            assert_eq!(
                missing.len(),
                SYMBOLS.len(),
                "every symbol is reported, not just the first"
            );
            assert!(missing.iter().any(|m| m == "nixl_capi_create_configured_agent"));
        }
        other => panic!("expected MissingSymbols, got {other:?}"),
    }
}

#[test]
fn a_missing_file_is_an_open_error_that_says_what_to_install() {
    let err = Library::load("/nonexistent/.nixl_cu12.mesonpy.libs/libnixl_capi.so").unwrap_err();
    assert!(matches!(err, LoadError::Open { .. }), "{err:?}");
    assert!(err.to_string().contains("nixl-cu12"), "{err}");
}

//! What the NIXL tests share: where the wheel's C API library is, or why they do not run.

use kvpush_nixl::CAPI_PATH_ENV;

/// Set (as `scripts/dev test` and CI set it), a missing library fails the tests instead of
/// skipping them: there NIXL is installed, and a skip would hide a failed lookup.
pub const REQUIRE_ENV: &str = "KVPUSH_REQUIRE_NIXL";

/// The library's path from `KVPUSH_NIXL_CAPI`; `None` (after printing SKIP) when it is unset or
/// empty, unless `KVPUSH_REQUIRE_NIXL` is set, which makes that a failure.
pub fn capi_path() -> Option<String> {
    match std::env::var(CAPI_PATH_ENV) {
        Ok(path) if !path.is_empty() => Some(path),
        _ if std::env::var_os(REQUIRE_ENV).is_some_and(|v| !v.is_empty()) => panic!(
            "{CAPI_PATH_ENV} is not set and {REQUIRE_ENV} requires NIXL: point it at the wheel's \
             libnixl_capi.so (python -c 'import kvpush.nixl; print(kvpush.nixl.library_path())')"
        ),
        _ => {
            eprintln!(
                "SKIP: {CAPI_PATH_ENV} is not set (pip install nixl-cu12==1.5.1, then point it \
                 at .nixl_cu12.mesonpy.libs/libnixl_capi.so); NIXL tests not run"
            );
            None
        }
    }
}

//! The Lua scripts, one `.lua` file each beside this one, each behind the
//! shared helpers of `lua/lib.lua`. redis-rs' `Script` calls them by SHA
//! (`EVALSHA`) and loads them when the server answers `NOSCRIPT` (after a
//! restart or `SCRIPT FLUSH`).
//!
//! Every write script starts with the `#!lua` shebang: Redis then checks
//! for `OOM` and `MISCONF` before the script runs, and refuses it whole,
//! so a script never stops halfway through its writes. A write script
//! makes every refusal before its first write.

use std::sync::LazyLock;

use ::redis::Script;

macro_rules! script {
    ($name:ident, $file:literal) => {
        pub(crate) static $name: LazyLock<Script> = LazyLock::new(|| {
            Script::new(concat!(
                "#!lua\n",
                include_str!("lua/lib.lua"),
                include_str!(concat!("lua/", $file))
            ))
        });
    };
    ($name:ident, $file:literal, read_only) => {
        pub(crate) static $name: LazyLock<Script> = LazyLock::new(|| {
            Script::new(concat!(
                "#!lua flags=no-writes\n",
                include_str!("lua/lib.lua"),
                include_str!(concat!("lua/", $file))
            ))
        });
    };
}

script!(PUT_RUN, "put_run.lua");
script!(PATCH_RUN, "patch_run.lua");
script!(PUT_SESSION, "put_session.lua");
script!(DELETE_SESSION, "delete_session.lua");
script!(TRAYS, "trays.lua");
script!(IMPORT, "import.lua");
script!(PRUNE, "prune.lua");
script!(LIST_RUNS, "list_runs.lua", read_only);
script!(READ_PAGES, "read_pages.lua", read_only);
script!(BUDGETS, "budgets.lua");

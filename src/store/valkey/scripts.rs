//! The Lua scripts, compiled into the binary. Each is the shared prelude (`lua/lib.lua`) followed
//! by one operation, so validation and reply caching are written once.

use std::sync::LazyLock;

use redis::Script;

/// One script: its source and its prepared, hashed form.
pub struct LuaScript {
    /// The full source sent by `SCRIPT LOAD` / `EVAL`.
    pub source: &'static str,
    /// The prepared script, run with EVALSHA.
    pub script: Script,
}

macro_rules! lua {
    ($file:literal) => {{
        let source = concat!(
            include_str!("../../../lua/lib.lua"),
            "\n",
            include_str!(concat!("../../../lua/", $file))
        );
        LuaScript {
            source,
            script: Script::new(source),
        }
    }};
}

/// One compiled script per operation.
pub struct Scripts {
    /// `lua/acquire.lua`
    pub acquire: LuaScript,
    /// `lua/renew.lua`
    pub renew: LuaScript,
    /// `lua/release.lua`
    pub release: LuaScript,
    /// `lua/commit.lua`
    pub commit: LuaScript,
    /// `lua/check.lua`
    pub check: LuaScript,
    /// `lua/read.lua`
    pub read: LuaScript,
    /// `lua/inspect.lua`
    pub inspect: LuaScript,
    /// `lua/repair.lua`
    pub repair: LuaScript,
}

/// The scripts, hashed once per process.
pub static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    acquire: lua!("acquire.lua"),
    renew: lua!("renew.lua"),
    release: lua!("release.lua"),
    commit: lua!("commit.lua"),
    check: lua!("check.lua"),
    read: lua!("read.lua"),
    inspect: lua!("inspect.lua"),
    repair: lua!("repair.lua"),
});

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MAX_TOKEN, MAX_TOKEN_LEAD_MICROS};

    /// The bounds the scripts enforce are the ones the memory backend and the controller use.
    #[test]
    fn lua_constants_match_rust() {
        let lib = include_str!("../../../lua/lib.lua");
        for (line, value) in [
            ("local MAX_TOKEN = ", MAX_TOKEN),
            ("local MAX_LEAD = ", MAX_TOKEN_LEAD_MICROS),
        ] {
            let expected = format!("{line}{value}\n");
            assert!(
                lib.contains(&expected),
                "lua/lib.lua lacks `{}`",
                expected.trim()
            );
        }
        assert!(SCRIPTS.acquire.source.contains("next_token("));
    }
}

//! `tessera nvmf perf`: the initiator's host options plus the load generator's workload
//! (`tessera_load::nvmf_perf`).

use clap::Args;

use crate::nvmf_cmd::HostArgs;

#[derive(Args, Clone, Debug)]
pub struct NvmfPerfArgs {
    #[command(flatten)]
    host: HostArgs,
    #[command(flatten)]
    load: tessera_load::nvmf_perf::NvmfPerfArgs,
}

pub fn run(a: NvmfPerfArgs) -> Result<(), String> {
    tessera_load::nvmf_perf::run(a.host.addr(), a.host.options()?, a.load)
}

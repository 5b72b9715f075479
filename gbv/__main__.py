from gbv.cli import console

console()

#!/usr/bin/perl
# tests/gpu/emu/cu2cpp.pl - turn one kernels/cuda/*.cu file into host C++ for
# the emulator:   perl cu2cpp.pl in.cu > out.cpp
#
# Why shaped so: the .cu files stay the single source, so the rewrite is
# mechanical and small, and everything else is done by the emulator's
# headers (include/cuda_runtime.h defines __global__, __device__, ... away):
#   - `callee<<<grid, block[, smem[, stream]]>>>(args);` becomes
#     `emu_launch((const void *)&callee, "callee", "file:line", grid, block,
#     smem, stream, [&] { callee(args); });` - the callee may carry template
#     arguments and stand on the line before the <<<;
#   - `__shared__ T name[...];` becomes a static plus a one-time registration
#     (the emulator poisons registered shared memory before each block);
#   - `extern __shared__ T name[];` becomes a pointer to the block's dynamic
#     shared memory;
#   - `#pragma unroll` goes (g++ warns on it).
# Line numbers are kept (a #line directive names the .cu file), so compiler
# errors and emulator faults point into the .cu source.
use strict;
use warnings;

my $path = shift @ARGV or die "usage: cu2cpp.pl FILE.cu\n";
open my $fh, '<', $path or die "cu2cpp.pl: $path: $!\n";
my $src = do { local $/; <$fh> };
close $fh;
(my $base = $path) =~ s{.*/}{};

# the line a character offset is on (1-based)
sub line_at { my ($s, $off) = @_; return 1 + (substr($s, 0, $off) =~ tr/\n//); }

# split a launch configuration on its top-level commas
sub split_top {
    my ($s) = @_;
    my @parts;
    my ($depth, $cur) = (0, '');
    for my $ch (split //, $s) {
        if ($ch =~ /[(\[{]/) { $depth++; }
        elsif ($ch =~ /[)\]}]/) { $depth--; }
        if ($ch eq ',' && $depth == 0) { push @parts, $cur; $cur = ''; next; }
        $cur .= $ch;
    }
    push @parts, $cur;
    return map { s/^\s+|\s+$//gr } @parts;
}

my $out = '';
my $pos = 0;
my $n_launch = 0;
while ($src =~ /([A-Za-z_][\w:]*)(\s*<(?:[^<>;]++|(?2))*>)?(\s*)<<<(.*?)>>>\s*((\((?:[^()]++|(?-1))*\)))\s*;/gs) {
    my ($callee, $targs, $cfg, $args) = ($1, $2 // '', $4, $5);
    my ($start, $end) = ($-[0], $+[0]);
    my $whole = substr($src, $start, $end - $start);
    my $line = line_at($src, $start);
    my @c = split_top($cfg);
    die "cu2cpp.pl: $base:$line: launch configuration '$cfg' has " . scalar(@c) . " parts\n" if @c < 2 || @c > 4;
    push @c, '0' while @c < 4;
    (my $name = "$callee$targs") =~ s/\s+/ /g;
    my $fn = "$callee$targs";
    # keep the line count: the replacement has as many newlines as the original
    my $nl = ($whole =~ tr/\n//);
    my $rep = "emu_launch((const void *)&$fn, \"$name\", \"$base:$line\", $c[0], $c[1], $c[2], $c[3], [&] { $fn$args; });";
    my $rep_nl = ($rep =~ tr/\n//);
    $rep .= "\n" x ($nl - $rep_nl) if $nl > $rep_nl;
    $out .= substr($src, $pos, $start - $pos) . $rep;
    $pos = $end;
    $n_launch++;
}
$out .= substr($src, $pos);

# extern __shared__ T name[];  ->  T *name = (T *)emu_dynamic_smem();
$out =~ s/\bextern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+(?:\s*\*)?)\s+(\w+)\s*\[\s*\]\s*;/$1 *$2 = reinterpret_cast<$1 *>(emu_dynamic_smem());/g;
# __shared__ T name[...];  ->  static T name[...]; registered once
$out =~ s/\b__shared__\s+([^;{}()]*?)\b(\w+)\s*((?:\[[^\];]*\]\s*)*);/static $1$2$3; static const bool emu_reg_$2 = emu_shared_register(&$2, sizeof $2); (void)emu_reg_$2;/g;
$out =~ s/^[ \t]*#\s*pragma\s+unroll\b.*$//mg;

die "cu2cpp.pl: $base: a <<< launch was left untransformed\n" if $out =~ /<<</;
print "#line 1 \"$path\"\n", $out;
print STDERR "cu2cpp.pl: $base: $n_launch launches\n" if $ENV{CU2CPP_VERBOSE};
